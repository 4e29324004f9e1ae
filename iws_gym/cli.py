"""The `iws` command. Each subcommand is a thin shell over a library function; `iws <cmd> --help` for its flags."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _task(name):
    from iws_gym.envs.registry import load_task

    return load_task(name)


def cmd_collect(a):
    from iws_gym.data.collect import collect

    meta = collect(_task(a.task), a.episodes, Path(a.out), seed=a.seed, steps=a.steps, resume=a.resume, mix=a.mix,
                   workers=a.workers, policy=a.policy)
    print(json.dumps(meta, indent=2))


def cmd_generate(a):
    from iws_gym.data.generate import generate

    _emit(generate(_task(a.task), Path(a.out), a.episodes, steps=a.steps, seed=a.seed, policy=a.policy,
                   checkpoint=a.checkpoint, num_envs=a.num_envs, device=a.device, resume=a.resume), None)


def cmd_data_stats(a):
    from iws_gym.data.stats import dataset_stats

    stats = dataset_stats(Path(a.data), plot=Path(a.plot) if a.plot else None, loader_batches=a.loader_batches)
    _emit(stats, a.json)


def cmd_merge(a):
    from iws_gym.data.episodes import merge_datasets

    _emit(merge_datasets(a.data, Path(a.out)), None)


def cmd_eval_pose(a):
    from iws_gym.evaluation.fidelity import validate_pose_estimator

    _emit(validate_pose_estimator(_task(a.task), a.episodes, a.steps), a.json)


def cmd_eval_fidelity(a):
    from iws_gym.evaluation.fidelity import fidelity

    from iws_gym.models.world_model import release_settings

    settings = release_settings(a.checkpoint or _task(a.task).checkpoint_path, decoder_steps=a.decoder_steps,
                                dynamics_steps=a.dynamics_steps, dynamics_sampler=a.dynamics_sampler, reencode=a.reencode,
                                reencode_every=a.reencode_every, ctx_sigma=a.ctx_sigma)
    report = fidelity(_task(a.task), a.checkpoint, horizon=a.horizon, episodes=a.episodes, behaviour=a.behaviour,
                      settings=settings, plot=Path(a.plot) if a.plot else None, grid=Path(a.grid) if a.grid else None,
                      split=a.split)
    _emit(report, a.json, summary_only=True)


def cmd_eval_compare(a):
    from iws_gym.evaluation.fidelity import compare_fidelity

    reports = []
    for path in (a.a, a.b):
        if not Path(path).is_file():
            raise FileNotFoundError(f"report {path} does not exist")
        try:
            reports.append(json.loads(Path(path).read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"report {path} is not valid JSON ({e})") from None
    result = compare_fidelity(*reports, predictor=a.predictor)
    result["a"]["report"], result["b"]["report"] = a.a, a.b
    _emit(result, a.json)


def cmd_eval_contact(a):
    from iws_gym.evaluation.fidelity import contact_error

    _emit(contact_error(_task(a.task), a.checkpoint, a.data, a.train_episodes, a.heldout, a.steps, a.windows, a.seed,
                        dynamics_steps=a.dynamics_steps, dynamics_sampler=a.dynamics_sampler), a.json)


def cmd_eval_policy(a):
    from iws_gym.evaluation.policy_eval import evaluate_policy

    _emit(evaluate_policy(_task(a.task), a.policy, a.episodes, a.horizon, a.seed, a.ground_truth, a.checkpoint, a.device,
                          video=a.video, video_episodes=a.video_episodes, stop_untrusted=a.stop_untrusted,
                          learned=not a.ground_truth_only), a.json)


def cmd_eval_stability(a):
    from iws_gym.evaluation.stability import stability

    _emit(stability(_task(a.task), a.checkpoint, steps=a.steps, check_every=a.check_every, kinds=a.actions,
                    seed=a.seed, strip=Path(a.strip) if a.strip else None, device=a.device, reencode=a.reencode,
                    reencode_every=a.reencode_every, calib_episodes=a.calib_episodes, calib_steps=a.calib_steps,
                    drives=a.drives, ground_truth=a.ground_truth), a.json)


def cmd_eval_scorer(a):
    from iws_gym.evaluation.fidelity import scorer_validation

    _emit(scorer_validation(_task(a.task), a.checkpoint, episodes=a.episodes, steps=a.steps, behaviour=a.behaviour), a.json)


def cmd_eval_correlate(a):
    from iws_gym.evaluation.policy_eval import correlate, plot_correlation, reanalyse

    if a.from_json:  # re-analyse a stored report: nothing is rerun
        report = reanalyse(a.from_json)
        if a.plot:
            plot_correlation(report, Path(a.plot))
            report["plot"] = a.plot
        return _emit(report, a.json)
    extra = {}
    for item in a.add_policy or []:
        name, sep, spec = item.partition("=")
        if not sep or not name or not spec:
            raise ValueError(f"--add-policy takes NAME=SPEC (MODULE:CALLABLE or a policy's .safetensors), got {item!r}")
        extra[name] = spec
    _emit(correlate(_task(a.task), a.episodes, a.horizon, a.seed, a.checkpoint, a.device, names=a.policies, extra=extra,
                    plot=Path(a.plot) if a.plot else None, workers=a.workers,
                    reencode=a.reencode, reencode_every=a.reencode_every, stop_untrusted=a.stop_untrusted), a.json)


def cmd_eval_datagen(a):
    from iws_gym.evaluation.datagen import datagen

    _emit(datagen(_task(a.task), Path(a.real), Path(a.out), a.episodes, tuple(a.shares), a.train_steps, a.eval_episodes,
                  a.horizon, a.checkpoint, a.device, Path(a.grid) if a.grid else None, a.preset, a.batch,
                  a.successful_only, a.max_generated), a.json)


def cmd_eval_probe(a):
    from iws_gym.evaluation.probe import probe

    _emit(probe(_task(a.task), a.checkpoint, steps=a.steps, episodes=a.episodes, grid=Path(a.grid) if a.grid else None,
                device=a.device), a.json)


def cmd_eval_transport(a):
    from iws_gym.evaluation.transport import transport

    _emit(transport(_task(a.task), a.checkpoint, episodes=a.episodes, steps=a.steps, check_every=a.check_every,
                    split=a.split, margin=a.margin, grid=Path(a.grid) if a.grid else None, once=a.once), a.json)


def cmd_eval_trust(a):
    from iws_gym.evaluation.trust import trust_report

    _emit(trust_report(_task(a.task), a.checkpoint, episodes=a.episodes, steps=a.steps, split=a.split,
                       behaviours=a.behaviours, fit_calibration=a.fit, fit_episodes=a.fit_episodes, alpha=a.alpha,
                       force=a.force, plot_path=Path(a.plot) if a.plot else None, device=a.device), a.json)


def cmd_eval_recon(a):
    from iws_gym.evaluation.fidelity import reconstruction

    _emit(reconstruction(_task(a.task), a.checkpoint, frames=a.frames, steps_list=a.steps, sigma_mids=a.sigma_mid,
                         grid=Path(a.grid) if a.grid else None), a.json)


def cmd_train(a):
    if a.stage == "recipe":
        from iws_gym.training.recipe import main as recipe_main

        return recipe_main(a.rest)
    from iws_gym.training.train import main as train_main

    train_main(a.stage, a.rest)


def cmd_train_policy(a):
    from iws_gym.training.train import main as train_main

    train_main("policy", a.rest[1:] if a.rest[:1] == ["--"] else a.rest)


def cmd_dagger(a):
    from iws_gym.data.dagger import collect_labels

    _emit(collect_labels(a.policy, a.episodes, a.seed, a.out, horizon=a.horizon, beta=a.beta, task_name=a.task,
                        expert=a.expert), a.json)


def cmd_train_bc(a):
    from iws_gym.policies.bc import train_bc

    _emit(train_bc(a.data, a.out, steps=a.steps, batch=a.batch, lr=a.lr, save_at=tuple(a.save_at),
                   max_episodes=a.max_episodes, seed=a.seed), a.json)


def cmd_demo(a):
    from iws_gym.evaluation.demo import demo

    _emit(demo(a.checkpoint, a.episodes, a.steps, a.seed, Path(a.video) if a.video else None, a.device), a.json)


def cmd_export_lerobot(a):
    from iws_gym.data.lerobot import export_lerobot

    _emit(export_lerobot(Path(a.data), Path(a.out), fps=a.fps, max_episodes=a.max_episodes), None)


def cmd_export_release(a):
    from iws_gym.training.release import export_run

    _emit(export_run(Path(a.run), Path(a.out)), None)


def cmd_bench(a):
    from iws_gym.evaluation.bench import bench

    _emit(bench(a.checkpoint, a.device, a.steps, tuple(a.batch_sizes), a.rollout_steps, a.batch_steps, a.compile,
                a.precision, a.reencode_every, a.trust), a.json)


def cmd_release(a):
    from iws_gym.training.release import parse_settings, release

    _emit(release(Path(a.run), a.stage, Path(a.dest), [Path(r) for r in a.report], a.command,
                  parse_settings(a.set)), None)


def _emit(report: dict, path: str | None, summary_only: bool = False):
    from iws_gym.data.episodes import write_json_atomic

    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path(path), report)
    shown = {k: report[k] for k in ("summary", "pose_estimator_error") if k in report} if summary_only else report
    print(json.dumps(shown, indent=2, default=str))


def _add_reencode_every(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reencode-every", type=int, default=None, metavar="K",
                   help="re-encode only every K-th frame into the context (gym.make(..., reencode_every=K); "
                        "default: the env's, every frame)")


def build_parser() -> argparse.ArgumentParser:
    from iws_gym.data.collect import HELDOUT_BEHAVIOURS, PLAY_BEHAVIOURS
    from iws_gym.data.splits import SPLITS

    p = argparse.ArgumentParser(prog="iws", description="iws-gym: a learned Push-T simulator as a Gymnasium env")
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("collect", help="record scripted play in the ground-truth simulator")
    c.add_argument("--task", default="tpushing", help="task config name (envs/configs/<task>.toml): tpushing | pilesweeping")
    c.add_argument("--episodes", type=int, required=True, help="number of episodes (> 0)")
    c.add_argument("--out", required=True, help="new or empty output directory")
    c.add_argument("--seed", type=int, default=0, help="episode i uses seed S+i (must stay below the held-out range)")
    c.add_argument("--steps", type=int, default=None, help="steps per episode (default: the task's episode_steps)")
    c.add_argument("--resume", action="store_true", help="complete an interrupted collection in --out")
    c.add_argument("--workers", type=int, default=1, help="processes recording episodes at once (one per core)")
    c.add_argument("--mix", default="play", choices=["play", "jittery", "random", "expert", "intervention", "expert_markov"],
                   help="play: the task's default behaviour mix; jittery: whole episodes of pushing with random jumps; "
                        "random: whole episodes of a uniform-random target every step (the stability check's random drive); "
                        "expert: demonstrations of the task's demonstrator (tpushing: the planning expert; pilesweeping: "
                        "the scripted sweeper), each ending at success; expert_markov (tpushing): the planning expert "
                        "replanning every 8 steps from the state alone, a teacher a chunked policy can imitate; intervention: --policy "
                        "acts for 10-199 steps, then the expert takes over (DAgger-style corrections; the learner's "
                        "steps are stored as segment 'learner' and never imitated). pilesweeping takes play, random, expert")
    c.add_argument("--policy", default=None, help="--mix intervention: the learner, MODULE:CALLABLE or a policy's .safetensors")
    c.set_defaults(fn=cmd_collect)

    g = sub.add_parser("generate", help="record demonstrations inside the learned world (marked as generated)")
    g.add_argument("--task", default="tpushing")
    g.add_argument("--episodes", type=int, required=True, help="number of episodes (> 0)")
    g.add_argument("--out", required=True, help="new or empty output directory")
    g.add_argument("--seed", type=int, default=0, help="episode i starts from gym-pusht's start of seed S+i (below "
                                                      "the held-out range)")
    g.add_argument("--steps", type=int, default=None, help="most steps per episode; an episode also ends at the "
                                                         "learned env's success (default: the task's episode_steps)")
    g.add_argument("--policy", default="iws_gym.policies:FramePusher",
                   help="MODULE:CALLABLE acting on gym-pusht observations (default: the scripted demonstrator, "
                        "reading the T from the frame)")
    g.add_argument("--checkpoint", default=None)
    g.add_argument("--num-envs", type=int, default=8, help="learned worlds stepped in one batch")
    g.add_argument("--resume", action="store_true", help="complete an interrupted generation into the same --out")
    g.add_argument("--device", default="auto")
    g.set_defaults(fn=cmd_generate)

    s = sub.add_parser("data-stats", help="behaviour-mix statistics, plots and loader throughput of a dataset")
    s.add_argument("--data", required=True)
    s.add_argument("--json", default=None)
    s.add_argument("--plot", default=None, help="PNG with the coverage histogram and workspace occupancy")
    s.add_argument("--loader-batches", type=int, default=50)
    s.set_defaults(fn=cmd_data_stats)

    m = sub.add_parser("merge", help="one dataset of several (e.g. play and expert demonstrations), by links, nothing copied")
    m.add_argument("--data", nargs="+", required=True, help="the datasets, in order")
    m.add_argument("--out", required=True, help="a new (or empty) directory")
    m.set_defaults(fn=cmd_merge)

    t = sub.add_parser("train", help="train a stage: stage1 (autoencoder), stage2 (dynamics); resumes from OUT/last.pt")
    t.add_argument("stage", choices=["stage1", "stage2", "compact1", "compact2", "recipe"],
                   help="stage1, stage2 (the spatial design), compact1, compact2 (the compact design, models/compact.py), "
                        "or recipe: collection, both stages and the release in one resumable command")
    t.add_argument("rest", nargs=argparse.REMAINDER, help="stage flags, see `iws train STAGE --help`")
    t.set_defaults(fn=cmd_train)

    tp = sub.add_parser("train-policy", add_help=False,
                        help="the visuomotor policy (iws_gym.policies:visuomotor) on demonstrations; resumes from OUT/last.pt")
    tp.add_argument("rest", nargs=argparse.REMAINDER, help="see `iws train-policy --help`")
    tp.set_defaults(fn=cmd_train_policy)

    dg = sub.add_parser("dagger", help="the planning expert's corrections on a pose-bottleneck policy's own states "
                                       "(labels for `iws train-policy --labels`)")
    dg.add_argument("--task", default="tpushing")
    dg.add_argument("--policy", required=True, help="the learner: a pose-bottleneck policy release (.safetensors)")
    dg.add_argument("--episodes", type=int, default=50)
    dg.add_argument("--seed", type=int, default=230000, help="first training seed (below the held-out base)")
    dg.add_argument("--horizon", type=int, default=300)
    dg.add_argument("--beta", type=float, default=0.3, help="probability that a chunk is the expert's, not the learner's")
    dg.add_argument("--expert", default="planning", choices=["planning", "markov"],
                    help="the labeller: the planning expert as it demonstrates (--mix expert), or its Markov form (--mix "
                         "expert_markov), which continues a push from beside the block instead of backing off first")
    dg.add_argument("--out", required=True, help="label file (.npz), rewritten after every episode")
    dg.add_argument("--json", default=None, help="a summary: labels, the episodes' scores")
    dg.set_defaults(fn=cmd_dagger)

    tb = sub.add_parser("train-bc", help="behaviour-cloning policy on the pushing segments of a dataset (policy suite)")
    tb.add_argument("--data", required=True)
    tb.add_argument("--out", required=True)
    tb.add_argument("--steps", type=int, default=4000)
    tb.add_argument("--batch", type=int, default=128)
    tb.add_argument("--lr", type=float, default=1e-3)
    tb.add_argument("--save-at", type=int, nargs="+", default=[300, 1000, 4000])
    tb.add_argument("--max-episodes", type=int, default=300)
    tb.add_argument("--seed", type=int, default=0)
    tb.add_argument("--json", default=None)
    tb.set_defaults(fn=cmd_train_bc)

    e = sub.add_parser("eval", help="measurements against the ground truth")
    esub = e.add_subparsers(dest="what", required=True)
    ep = esub.add_parser("pose", help="error of the pixel pose estimator on ground-truth frames")
    ep.add_argument("--task", default="tpushing")
    ep.add_argument("--episodes", type=int, default=20)
    ep.add_argument("--steps", type=int, default=100)
    ep.add_argument("--json", default=None)
    ep.set_defaults(fn=cmd_eval_pose)

    ef = esub.add_parser("fidelity", help="open-loop rollout fidelity on held-out episodes, with baselines")
    ef.add_argument("--task", default="tpushing")
    ef.add_argument("--checkpoint", default=None, help="checkpoint dir; omit to report the baselines only")
    ef.add_argument("--horizon", type=int, default=192)
    ef.add_argument("--episodes", type=int, default=16)
    ef.add_argument("--behaviour", default="mix", choices=list(HELDOUT_BEHAVIOURS),
                    help="held-out play as in training, an unseen scripted policy, jittery pushes (iws collect --mix jittery), "
                         "a uniform-random target every step (as `iws eval stability` drives the model), or the planning "
                         "expert's competent pushes (what a good policy does)")
    ef.add_argument("--split", default="test", choices=list(SPLITS),
                    help="named held-out split (iws_gym/data/splits.py): test for reports, validation for choosing settings")
    ef.add_argument("--decoder-steps", type=int, default=None)
    ef.add_argument("--dynamics-steps", type=int, default=None, help="sampler steps per dynamics prediction (default: the model's)")
    ef.add_argument("--dynamics-sampler", default=None, choices=["consistency", "euler"],
                    help="consistency jumps or Euler steps of the probability-flow ODE (default: the model's own)")
    ef.add_argument("--reencode", default=None, action=argparse.BooleanOptionalAction,
                    help="encode each decoded frame back into the context (default: the release's; the spatial "
                         "design does, the compact one does not)")
    _add_reencode_every(ef)
    ef.add_argument("--ctx-sigma", type=float, default=None,
                    help="noise level of the context latents at inference (default: the release's, 0.02)")
    ef.add_argument("--plot", default=None, help="PNG of per-step metrics")
    ef.add_argument("--grid", default=None, help="PNG of the first 3 episodes' frames, true above predicted, at steps 0-192")
    ef.add_argument("--json", default=None)
    ef.set_defaults(fn=cmd_eval_fidelity)

    ecm = esub.add_parser("compare", help="paired per-episode comparison of two fidelity reports on the same episodes")
    ecm.add_argument("a", help="the baseline's `iws eval fidelity --json` report")
    ecm.add_argument("b", help="the candidate's report, on the same held-out episodes")
    ecm.add_argument("--predictor", default="model", choices=["model", "copy_first_frame", "ground_truth_rerender"])
    ecm.add_argument("--json", default=None)
    ecm.set_defaults(fn=cmd_eval_compare)

    eco = esub.add_parser("contact", help="one-step dynamics error on all vs block-moving windows, train vs held out")
    eco.add_argument("--task", default="tpushing")
    eco.add_argument("--checkpoint", default=None, help="checkpoint dir (default: the task's shipped weights)")
    eco.add_argument("--data", default="data/tpushing", help="the training dataset (its first --train-episodes)")
    eco.add_argument("--train-episodes", type=int, default=100)
    eco.add_argument("--heldout", type=int, default=16, help="held-out episodes generated from unseen seeds")
    eco.add_argument("--steps", type=int, default=100, help="steps per held-out episode")
    eco.add_argument("--windows", type=int, default=256, help="windows per set and kind")
    eco.add_argument("--seed", type=int, default=0)
    eco.add_argument("--dynamics-steps", type=int, default=None, help="sampler steps per prediction (default: the model's)")
    eco.add_argument("--dynamics-sampler", default=None, choices=["consistency", "euler"])
    eco.add_argument("--json", default=None)
    eco.set_defaults(fn=cmd_eval_contact)
    epo = esub.add_parser("policy", help="Monte-Carlo policy evaluation in the learned env (and the ground truth)")
    epo.add_argument("--task", default="tpushing")
    epo.add_argument("--policy", required=True, help="MODULE:CALLABLE, e.g. iws_gym.policies:FramePusher")
    epo.add_argument("--episodes", type=int, default=50)
    epo.add_argument("--horizon", type=int, default=300)
    epo.add_argument("--seed", type=int, default=0)
    epo.add_argument("--ground-truth", action="store_true", help="also run the same starts in gym-pusht")
    epo.add_argument("--ground-truth-only", action="store_true",
                     help="run only gym-pusht (a demonstrator's or a policy's real-world score; no weights needed)")
    epo.add_argument("--checkpoint", default=None)
    epo.add_argument("--device", default="auto")
    epo.add_argument("--json", default=None)
    epo.add_argument("--video", default=None, help="write the first episodes side by side as an mp4 (with --ground-truth, "
                                                   "gym-pusht above the learned env)")
    epo.add_argument("--video-episodes", type=int, default=4)
    epo.add_argument("--stop-untrusted", action="store_true",
                     help="end a learned episode once its trust falls below 0.5 (it counts as untrusted)")
    epo.set_defaults(fn=cmd_eval_policy)

    es = esub.add_parser("stability", help="very long open-loop rollouts: first step where a frame stops being valid")
    es.add_argument("--task", default="tpushing")
    es.add_argument("--checkpoint", default=None)
    es.add_argument("--steps", type=int, default=9000)
    es.add_argument("--check-every", type=int, default=10)
    es.add_argument("--actions", nargs="+", default=["random", "scripted"], choices=["random", "scripted", "hold"],
                    help="drives: uniform-random targets, held-out scripted play, hold (the agent commanded to stay "
                         "put: a still world must stay still)")
    es.add_argument("--seed", type=int, default=0)
    es.add_argument("--drives", type=int, default=1,
                    help="rollouts of each kind, stepped together, each from its own held-out start (and its own "
                         "random targets or scripted episodes): the shares pool them, per_drive lists each")
    es.add_argument("--ground-truth", action="store_true",
                    help="also run the random and scripted drives in the ground truth (same starts, same actions): "
                         "whole shares of the real frames and of stage 1's round trip of them (the ceiling), and "
                         "the model's object error against the truth per tenth of the drive")
    es.add_argument("--device", default="auto")
    es.add_argument("--reencode", default=None, action=argparse.BooleanOptionalAction,
                    help="encode each decoded frame back into the context (default: the release's; the spatial "
                         "design does, the compact one does not)")
    _add_reencode_every(es)
    es.add_argument("--calib-episodes", type=int, default=8,
                    help="real episodes per drive (scripted, random targets) for the validity envelope, as many again "
                         "for its false-alarm check")
    es.add_argument("--calib-steps", type=int, default=200, help="steps of each of those episodes")
    es.add_argument("--strip", default=None, help="PNG: a row of frames across each rollout")
    es.add_argument("--json", default=None)
    es.set_defaults(fn=cmd_eval_stability)

    esc = esub.add_parser("scorer", help="coverage scorer and agent_pos read from frames vs gym-pusht's true state")
    esc.add_argument("--task", default="tpushing")
    esc.add_argument("--checkpoint", default=None, help="default: the shipped weights (model frames need stage 2)")
    esc.add_argument("--episodes", type=int, default=8)
    esc.add_argument("--steps", type=int, default=100)
    esc.add_argument("--behaviour", default="mix", choices=list(HELDOUT_BEHAVIOURS))
    esc.add_argument("--json", default=None)
    esc.set_defaults(fn=cmd_eval_scorer)

    ec = esub.add_parser("correlate", help="the policy suite in both worlds: Pearson r, Spearman rho, gaps, scatter plot")
    ec.add_argument("--task", default="tpushing")
    ec.add_argument("--episodes", type=int, default=16)
    ec.add_argument("--horizon", type=int, default=100)
    ec.add_argument("--seed", type=int, default=0)
    ec.add_argument("--policies", nargs="+", default=None, help="a subset of the suite (default: all)")
    ec.add_argument("--add-policy", action="append", metavar="NAME=SPEC",
                    help="add a policy to the suite (repeatable): MODULE:CALLABLE or a policy's weights, e.g. "
                         "visuomotor_5000=runs/visuomotor/visuomotor_step5000.safetensors")
    ec.add_argument("--workers", type=int, default=2, help="policies run at once in separate processes")
    ec.add_argument("--reencode", default=None, action=argparse.BooleanOptionalAction,
                    help="the learned env re-encodes each observation into its context (default: the release's)")
    _add_reencode_every(ec)
    ec.add_argument("--checkpoint", default=None)
    ec.add_argument("--device", default="auto")
    ec.add_argument("--plot", default=None)
    ec.add_argument("--json", default=None)
    ec.add_argument("--stop-untrusted", action="store_true",
                    help="end a learned episode once its trust falls below 0.5 (it counts as untrusted)")
    ec.add_argument("--from-json", default=None, metavar="REPORT",
                    help="recompute the suite-level figures of a stored correlate report from its per-episode scores")
    ec.set_defaults(fn=cmd_eval_correlate)

    edg = esub.add_parser("datagen", help="policies trained on 0/50/100%% demonstrations generated in the learned world, "
                                          "each evaluated in gym-pusht (resumable)")
    edg.add_argument("--task", default="tpushing", help="task of the real demonstrations")
    edg.add_argument("--real", required=True, help="real demonstrations (`iws collect --mix expert`)")
    edg.add_argument("--out", required=True, help="working directory: the generated data, the policies, their evaluations")
    edg.add_argument("--episodes", type=int, default=100, help="demonstrations each policy is trained on")
    edg.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.5, 1.0], help="shares of generated episodes")
    edg.add_argument("--train-steps", type=int, default=12000, help="`iws train-policy` steps of each policy")
    edg.add_argument("--eval-episodes", type=int, default=100, help="held-out gym-pusht starts per policy")
    edg.add_argument("--horizon", type=int, default=300, help="steps per evaluation episode")
    edg.add_argument("--preset", default="default", help="policy model preset (pose: the shipped policy's; tiny: tests)")
    edg.add_argument("--batch", type=int, default=64, help="`iws train-policy --batch` of each policy (1024 with --preset pose)")
    edg.add_argument("--successful-only", action="store_true",
                     help="train on generated episodes that end in the learned world's success only (more starts are "
                          "generated until there are --episodes of them; the all-real policy is shared with the plain run)")
    edg.add_argument("--max-generated", type=int, default=None,
                     help="with --successful-only: at most this many generated episodes (default 3 x --episodes)")
    edg.add_argument("--checkpoint", default=None, help="the world model that generates (default: the shipped one)")
    edg.add_argument("--device", default="auto", help="auto | cpu | cuda: where the world model and the training run")
    edg.add_argument("--grid", default=None, help="PNG: real demonstrations above their generated twins")
    edg.add_argument("--json", default=None, help="write the report here")
    edg.set_defaults(fn=cmd_eval_datagen)

    epr = esub.add_parser("probe", help="start from edited real frames (shifted goal, recoloured block, distractor)")
    epr.add_argument("--task", default="tpushing")
    epr.add_argument("--checkpoint", default=None)
    epr.add_argument("--steps", type=int, default=60)
    epr.add_argument("--episodes", type=int, default=4)
    epr.add_argument("--device", default="auto")
    epr.add_argument("--grid", default=None, help="PNG: unedited and edited rollouts, one row each")
    epr.add_argument("--json", default=None)
    epr.set_defaults(fn=cmd_eval_probe)

    et = esub.add_parser("transport", help="is the stage-1 latent transportable: warp it by the true motion, "
                                           "step after step, and check the decoded T stays whole")
    et.add_argument("--task", default="tpushing")
    et.add_argument("--checkpoint", default=None)
    et.add_argument("--episodes", type=int, default=8)
    et.add_argument("--steps", type=int, default=100)
    et.add_argument("--check-every", type=int, default=10, help="decode and check every this many steps")
    et.add_argument("--split", default="validation", help="held-out split of the episodes (data.splits)")
    et.add_argument("--margin", type=float, default=0.75,
                    help="cells whose centre is within this many cells of the T's or the agent's outline move with it")
    et.add_argument("--once", action="store_true", help="warp the first latent by the whole motion since the start "
                                                        "(one resampling) instead of step after step")
    et.add_argument("--grid", default=None, help="PNG: truth, warped pixels and the warped latent decoded, one row each")
    et.add_argument("--json", default=None)
    et.set_defaults(fn=cmd_eval_transport)

    etr = esub.add_parser("trust", help="calibration of the env's trust signal against gym-pusht on held-out episodes "
                                         "(AUROC for lost blocks, Spearman against the coverage gap)")
    etr.add_argument("--task", default="tpushing", help="task config name")
    etr.add_argument("--checkpoint", default=None, help="release directory (default: the shipped weights)")
    etr.add_argument("--episodes", type=int, default=16, help="episodes per behaviour")
    etr.add_argument("--steps", type=int, default=120)
    etr.add_argument("--split", default="test", help="held-out split reported on (data.splits)")
    etr.add_argument("--behaviours", nargs="+", default=list(PLAY_BEHAVIOURS),
                     help="held-out behaviours replayed (data.collect.HELDOUT_BEHAVIOURS)")
    etr.add_argument("--fit", action="store_true", help="first fit the calibration on validation episodes and write "
                                                         "it to CHECKPOINT/trust.json")
    etr.add_argument("--fit-episodes", type=int, default=16, help="validation episodes per behaviour for --fit")
    etr.add_argument("--alpha", type=float, default=0.1, help="--fit: EMA weight of a new step's signal")
    etr.add_argument("--force", action="store_true", help="--fit may replace an existing trust.json")
    etr.add_argument("--device", default="auto", help="auto | cpu | cuda")
    etr.add_argument("--plot", default=None, help="PNG: episode trust against block error and coverage gap, ROC")
    etr.add_argument("--json", default=None, help="write the report here")
    etr.set_defaults(fn=cmd_eval_trust)

    er = esub.add_parser("recon", help="stage-1 reconstruction quality and speed on held-out frames")
    er.add_argument("--task", default="tpushing")
    er.add_argument("--checkpoint", default=None)
    er.add_argument("--frames", type=int, default=512)
    er.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4], help="decoder step counts to report")
    er.add_argument("--sigma-mid", type=float, nargs="*", default=[], help="also sweep the second level of 2-step sampling")
    er.add_argument("--grid", default=None, help="PNG: originals, reconstructions per step count, error map")
    er.add_argument("--json", default=None)
    er.set_defaults(fn=cmd_eval_recon)
    d = sub.add_parser("demo", help="a scripted pusher plays IWS-TPushing-v0 and gym-pusht from the same starts; "
                                     "prints both scores, writes a video (gym-pusht above, learned below)")
    d.add_argument("--checkpoint", default=None, help="default: the shipped weights")
    d.add_argument("--episodes", type=int, default=2)
    d.add_argument("--steps", type=int, default=80)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--video", default="out/demo.mp4")
    d.add_argument("--device", default="auto")
    d.add_argument("--json", default=None)
    d.set_defaults(fn=cmd_demo)

    x = sub.add_parser("export", help="write a dataset in another project's layout")
    xsub = x.add_subparsers(dest="format", required=True)
    xl = xsub.add_parser("lerobot", help="LeRobotDataset v2.1: parquet episodes, an mp4 per episode, meta/ (info, "
                                          "episodes, tasks, stats)")
    xl.add_argument("--data", required=True)
    xl.add_argument("--out", required=True, help="a new (or empty) directory")
    xl.add_argument("--fps", type=int, default=10, help="frames per second (gym-pusht steps at 10 Hz)")
    xl.add_argument("--max-episodes", type=int, default=None, help="export only the first N episodes")
    xl.set_defaults(fn=cmd_export_lerobot)
    xr = xsub.add_parser("release", help="a training run's current weights (the EMA of its last.pt) as a release "
                                         "file, to evaluate a run before it ends")
    xr.add_argument("--run", required=True, help="the run directory (--out of `iws train`)")
    xr.add_argument("--out", required=True, help="directory for STAGE.safetensors (an existing file is not replaced)")
    xr.set_defaults(fn=cmd_export_release)

    b = sub.add_parser("bench", help="speed of the learned env on this device (latency, throughput, FLOPs, RSS)")
    b.add_argument("--checkpoint", default=None)
    b.add_argument("--device", default="auto")
    b.add_argument("--steps", type=int, default=200, help="single-env steps timed")
    b.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    b.add_argument("--batch-steps", type=int, default=20)
    b.add_argument("--rollout-steps", type=int, default=9000, help="long rollout for RSS / latency drift")
    b.add_argument("--compile", action="store_true", help="torch.compile the dynamics first (gym.make(..., compile=True))")
    b.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"],
                   help="number format of the networks (auto: bf16 where the hardware has it natively, else fp32)")
    _add_reencode_every(b)
    b.add_argument("--trust", default=True, action=argparse.BooleanOptionalAction,
                   help="compute the per-step trust signal (the env's default)")
    b.add_argument("--json", default=None)
    b.set_defaults(fn=cmd_bench)

    r = sub.add_parser("release", help="copy a trained stage into checkpoints/ with its provenance")
    r.add_argument("--run", required=True, help="run directory holding <stage>.safetensors and train_result.json, or a candidate "
                   "release (a directory with provenance.json) to promote with its provenance")
    r.add_argument("--stage", required=True, choices=["stage1", "stage2"])
    r.add_argument("--dest", default="checkpoints/tpushing")
    r.add_argument("--report", nargs="*", default=[], help="JSON reports measured on these weights")
    r.add_argument("--command", default=None, help="the exact training command, if train_result.json lacks it")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="change a config field of a release being promoted (or re-released in place) that acts only "
                   "at inference, e.g. denoiser_steps=10, or a rollout default, e.g. reencode_every=4 (the weights are unchanged; "
                   "recorded in the provenance)")
    r.set_defaults(fn=cmd_release)
    return p


COMMON_HELP = {  # options that mean the same in every command
    "task": "task config name (iws_gym/envs/configs/<task>.toml)",
    "json": "write the report to this JSON file (it is printed either way)",
    "checkpoint": "checkpoint directory with stage1/stage2 safetensors (default: the shipped weights)",
    "device": "auto (CUDA if present, else CPU) | cpu | cuda",
    "seed": "seed of the starts, the policies and the samplers",
    "episodes": "held-out episodes (or starts) to run",
    "steps": "steps per episode",
    "horizon": "steps per episode",
    "data": "dataset directory written by `iws collect`",
    "out": "output directory",
    "plot": "write a PNG plot here",
    "behaviour": "held-out drive: the training play mix, an unseen scripted sweep, jittery pushes, or a uniform-random "
                 "target every step",
    "mix": "play: the default behaviour mix; jittery: whole episodes of pushing with random jumps; random: whole "
           "episodes of a uniform-random target every step; expert: the planning expert's demonstrations",
    "loader_batches": "batches timed for the loader-speed figure",
    "batch": "batch size", "lr": "learning rate", "max_episodes": "use only the first N episodes",
    "save_at": "steps at which to save a policy checkpoint",
    "decoder_steps": "consistency steps of the decoder per frame (default: 1)",
    "dynamics_sampler": "the dynamics' sampler: consistency jumps or Euler steps of the probability-flow ODE "
                        "(default: the model's own)",
    "predictor": "which predictor of the reports to compare",
    "train_episodes": "training episodes (the first N of --data)",
    "video_episodes": "episodes shown in the video",
    "check_every": "steps between validity checks",
    "frames": "held-out frames to reconstruct",
    "video": "write an mp4 of the rollouts here",
    "batch_sizes": "vector-env sizes to time", "batch_steps": "steps timed per vector-env size",
    "precision": "number format of the networks (auto: bf16 where the hardware has it natively, else fp32)",
    "dest": "the release directory to write",
    "stage": "which stage",
}


def build_parser_with_help() -> argparse.ArgumentParser:
    """build_parser, with every option's help filled in (COMMON_HELP where a command gave none) and its
    default shown: `iws CMD --help` documents every flag."""
    p = build_parser()
    todo = [p]
    while todo:
        q = todo.pop()
        q.formatter_class = argparse.ArgumentDefaultsHelpFormatter
        for act in q._actions:
            if isinstance(act, argparse._SubParsersAction):
                todo.extend(act.choices.values())
            elif act.help is None and act.dest in COMMON_HELP:
                act.help = COMMON_HELP[act.dest]
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train-policy"]:  # every flag (--help too) belongs to the training loop's own parser
        argv = ["train-policy", "--", *argv[1:]]
    args = build_parser_with_help().parse_args(argv)
    try:
        args.fn(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:  # bad input: one line naming the problem
        print(f"iws {args.cmd}: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
