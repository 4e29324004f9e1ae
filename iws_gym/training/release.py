"""`iws release`: copy a trained stage into the shipped checkpoint directory with its provenance.

Provenance (`checkpoints/<task>/PROVENANCE.md` and `provenance.json`) records, per stage: the exact
training command, the data seed and episodes, steps and wall time, the commit that trained it, the
commit of the release, and the metrics measured on it (the JSON reports given with --report).
"""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

from iws_gym.models.checkpoint import git_commit
from iws_gym.data.episodes import write_json_atomic


def _norm(path) -> str:
    return str(Path(path)).rstrip("/")


def _run_dir(p: dict) -> str | None:
    """The run directory a provenance entry was released from (older entries: the command's --out)."""
    if p.get("run"):
        return p["run"]
    m = re.search(r"--out\s+(\S+)", p.get("command") or "")
    return _norm(m.group(1)) if m else None


def _summaries(reports: list[Path]) -> dict:
    out = {}
    for p in reports:
        if not Path(p).is_file():
            raise FileNotFoundError(f"report {p} does not exist")
        r = json.loads(Path(p).read_text())
        out[str(p)] = r.get("summary", r)
    return out


def _settable(kind: str):
    """-> (the config class of a release kind, the config fields `--set` may change: those that act only at
    inference). Every stage-2 release also takes rollout defaults (world_model.ROLLOUT_DEFAULT_FIELDS)."""
    from iws_gym.models.compact import STAGE2_KIND, CompactStage2Config

    fields = {STAGE2_KIND: (CompactStage2Config, ("denoiser_sigma", "denoiser_steps", "denoiser_sigma_min")),
              "stage2": (None, ())}
    if kind not in fields:
        raise ValueError(f"--set: a {kind!r} release has no fields that act only at inference")
    return fields[kind]


def parse_settings(items: list[str]) -> dict:
    """["KEY=VALUE", ...] -> {KEY: VALUE}, VALUE read as JSON (a bare word stays a string)."""
    out = {}
    for it in items:
        key, eq, value = it.partition("=")
        if not eq or not key:
            raise ValueError(f"--set takes KEY=VALUE, got {it!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def reconfigured(weights: Path, changes: dict) -> tuple[dict, dict, dict]:
    """The metadata and tensors of `weights` with fields of its config changed (fields that only act at inference,
    such as the compact denoiser's schedule: the weights are unchanged) and rollout defaults set (a stage-2
    release's `rollout` metadata: RolloutSettings fields such as reencode_every, which the env, the evaluations
    and the world model use unless told otherwise), each checked by rebuilding what it configures.
    -> (metadata strings, tensors, {field: [old, new]}). Nothing is written."""
    from iws_gym.models.checkpoint import _read_safetensors, config_from_dict, config_to_dict
    from iws_gym.models.compact import STAGE2_KIND, CompactWorldModel
    from iws_gym.models.world_model import ROLLOUT_DEFAULT_FIELDS, RolloutSettings, release_rollout

    meta, tensors = _read_safetensors(weights)
    cls, settable = _settable(meta.get("kind"))
    unknown = sorted(set(changes) - set(settable) - set(ROLLOUT_DEFAULT_FIELDS))
    if unknown:
        raise ValueError(f"--set: {unknown} cannot be changed on a {meta.get('kind')!r} release (only what acts at "
                         f"inference: {', '.join((*settable, *ROLLOUT_DEFAULT_FIELDS))})")
    out, changed = dict(meta), {}
    config_changes = {k: v for k, v in changes.items() if k in settable}
    if config_changes:
        cfg = json.loads(meta["config"])
        full = config_to_dict(config_from_dict(cls, cfg, where=f"{weights} config"))  # defaults of newer fields included
        changed.update({k: [full[k], v] for k, v in config_changes.items() if full[k] != v})
        cfg.update(config_changes)
        config_from_dict(cls, cfg, where=f"{weights} config with --set")
        out["config"] = json.dumps(cfg)
    rollout_changes = {k: v for k, v in changes.items() if k in ROLLOUT_DEFAULT_FIELDS}
    if rollout_changes:
        now = RolloutSettings(**release_rollout(weights.parent))
        try:
            new = dataclasses.replace(now, **rollout_changes)
            if meta.get("kind") == STAGE2_KIND:
                CompactWorldModel._check_settings(new)
        except (TypeError, ValueError) as e:
            raise ValueError(f"--set: bad rollout default for {weights}: {e}") from None
        changed.update({f"rollout.{k}": [getattr(now, k), v] for k, v in rollout_changes.items() if getattr(now, k) != v})
        out["rollout"] = json.dumps({**json.loads(meta.get("rollout") or "{}"), **rollout_changes})
    return out, tensors, changed


def promote(src: Path, stage: str, dest: Path, reports: list[Path], settings: dict | None = None) -> dict:
    """Make a candidate release (a directory written like checkpoints/<task>, with provenance.json) the
    release in `dest`: its weights and its provenance entry, chain included, move over unchanged; the
    release commit is now, and the reports given replace the candidate's (none given: they are kept).
    With src == dest this re-releases the weights in place with new reports. `settings`: config fields to change
    (`--set`), recorded in the provenance entry's `config_set` (every change made so far, oldest first)."""
    from iws_gym.models.checkpoint import _write_safetensors

    src, dest = Path(src), Path(dest)
    prov_src = json.loads((src / "provenance.json").read_text())
    if stage not in prov_src:
        raise ValueError(f"{src / 'provenance.json'} has no entry for {stage}")
    weights = src / f"{stage}.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} does not exist")
    same = src.resolve() == dest.resolve()  # re-releasing in place: new reports for the same weights
    entry = dict(prov_src[stage], released_at_commit=git_commit(),
                 promoted_from=prov_src[stage].get("promoted_from") if same else _norm(src))
    reconf = reconfigured(weights, settings) if settings else None  # checked before anything is written
    if reports:
        entry["reports"] = _summaries(reports)
    dest.mkdir(parents=True, exist_ok=True)
    if reconf is not None:
        meta, tensors, changed = reconf
        _write_safetensors(dest / f"{stage}.safetensors", tensors, meta)
        if "config" in meta:
            entry["config"] = json.loads(meta["config"])
        if "rollout" in meta:
            entry["rollout"] = json.loads(meta["rollout"])
        entry["config_set"] = list(entry.get("config_set") or []) + [dict(changes=changed, at_commit=entry["released_at_commit"])]
    elif not same:
        tmp = dest / f".{stage}.safetensors.tmp"
        shutil.copyfile(weights, tmp)
        tmp.replace(dest / f"{stage}.safetensors")
    prov_file = dest / "provenance.json"
    prov = json.loads(prov_file.read_text()) if prov_file.is_file() else {}
    prov[stage] = entry
    _write_provenance(dest, prov)
    return entry


def release(run: Path, stage: str, dest: Path, reports: list[Path], command: str | None = None,
            settings: dict | None = None) -> dict:
    """Release a trained stage from its run directory, or promote a candidate release: a directory
    with provenance.json and no train_result.json (see `promote`; only a promotion takes `settings`)."""
    from safetensors import safe_open

    run, dest = Path(run), Path(dest)
    src = run / f"{stage}.safetensors"
    if not src.is_file():
        raise FileNotFoundError(f"{src} does not exist: train the stage first")
    if (run / "provenance.json").is_file() and not (run / "train_result.json").is_file():
        return promote(run, stage, dest, reports, settings)
    if settings:
        raise ValueError("--set changes a release's config: release the run first, then --set on that release")
    result_file = run / "train_result.json"
    result = json.loads(result_file.read_text()) if result_file.is_file() else {}
    with safe_open(str(src), framework="pt") as f:
        meta = {k: json.loads(v) for k, v in (f.metadata() or {}).items() if k != "kind"}
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / f".{stage}.safetensors.tmp"
    shutil.copyfile(src, tmp)
    tmp.replace(dest / f"{stage}.safetensors")
    prov_file = dest / "provenance.json"
    prov = json.loads(prov_file.read_text()) if prov_file.is_file() else {}
    # a fine-tune (`--finetune RELEASE`) continues the weights released before it: keep that chain
    base = None
    if meta.get("finetuned_from") and stage in prov:
        old = prov[stage]
        if _run_dir(old) == _norm(run):
            # an earlier export of this same run (released again with new reports, or the run went on
            # after an intermediate release): the chain is the one that export had, not the export itself
            base = old.get("finetuned_from")
        else:
            base = {k: old.get(k) for k in ("command", "steps", "wall_s", "trained_at_commit", "finetuned_from")}
    prov[stage] = dict(
        file=f"{stage}.safetensors", run=_norm(run), size_mb=round((dest / f"{stage}.safetensors").stat().st_size / 2**20, 2),
        command=command or result.get("command"), data=meta.get("data"), data_seed=meta.get("data_seed"),
        data_episodes=meta.get("data_episodes"), steps=result.get("step", meta.get("step")),
        wall_s=result.get("wall_s"), device=result.get("device"), trained_at_commit=meta.get("commit"),
        released_at_commit=git_commit(), train_eval=meta.get("eval"), config=meta.get("config"),
        reports=_summaries(reports),
    )
    if base is not None:  # steps and wall time in total; this run's own in finetune_*
        prov[stage].update(finetune_steps=meta.get("finetune_steps"), finetune_wall_s=result.get("wall_s"),
                           steps=meta.get("step"), wall_s=round((result.get("wall_s") or 0) + (base["wall_s"] or 0), 1),
                           finetuned_from=base)
    _write_provenance(dest, prov)
    return prov[stage]


def _write_provenance(dest: Path, prov: dict) -> None:
    write_json_atomic(dest / "provenance.json", prov)
    lines = ["# Provenance of the shipped weights", "",
             "Written by `iws release`; the JSON twin is `provenance.json`. Weights are bf16 safetensors whose",
             "metadata carries the model config, so `WorldModel.from_pretrained` needs nothing else.", ""]
    for name, p in prov.items():
        data = (f"- data: `{p['data']}`, collection seed {p['data_seed']}, {p['data_episodes']} episodes "
                f"(regenerate: `iws collect --task tpushing --episodes {p['data_episodes']} --out {p['data']} "
                f"--seed {p['data_seed']}`)") if isinstance(p["data"], str) else (
                f"- data: {len(p['data'])} collections, {p['data_episodes']} episodes: "
                f"{', '.join(f'`{d}`' for d in p['data'])} (each one's `dataset.json` holds its seeds and mix)")
        lines += [f"## {name}", "", f"- file: `{p['file']}` ({p['size_mb']} MB)", f"- command: `{p['command']}`", data,
                  f"- steps: {p['steps']}, wall time: {p['wall_s']} s on {p['device']}",
                  f"- trained at commit `{p['trained_at_commit']}`, released at commit `{p['released_at_commit']}`",
                  f"- eval during training: `{json.dumps(p['train_eval'])}`"]
        for c in p.get("config_set") or []:
            lines.append(f"- config changed at release (commit `{c['at_commit']}`; the weights are unchanged): "
                         + ", ".join(f"`{k}` {old} -> {new}" for k, (old, new) in c["changes"].items()))
        if p.get("promoted_from"):
            lines.append(f"- promoted from the candidate release `{p['promoted_from']}` (run `{p.get('run')}`)")
        b = p.get("finetuned_from")
        while b:  # the runs it continues, newest first
            lines.append(f"- fine-tuned from the release trained by `{b['command']}` ({b['steps']} steps in total, "
                         f"{b['wall_s']} s, commit `{b['trained_at_commit']}`)")
            b = b.get("finetuned_from")
        for rp, summary in p["reports"].items():
            lines.append(f"- measured by `{rp}`: see that file; summary `{json.dumps(summary)[:600]}`")
        lines.append("")
    tmp = dest / ".PROVENANCE.md.tmp"
    tmp.write_text("\n".join(lines))
    tmp.replace(dest / "PROVENANCE.md")


def export_run(run: Path, out: Path) -> dict:
    """A training run's current weights (the EMA in its last.pt) as a release file in `out`, so a run can be
    evaluated before it ends; the release records the step and that it was exported mid-run."""
    import torch

    from iws_gym.models.checkpoint import config_from_dict, save_release
    from iws_gym.models.decoder import Stage1Config
    from iws_gym.models.dynamics import DynamicsConfig

    ckpt = Path(run) / "last.pt"
    if not ckpt.is_file():
        raise FileNotFoundError(f"{ckpt} does not exist: not a training run directory (or no checkpoint saved yet)")
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    classes = {"stage1": Stage1Config, "stage2": DynamicsConfig}
    if state.get("stage") not in classes:
        raise ValueError(f"{ckpt}: unknown stage {state.get('stage')!r}")
    dest = Path(out) / f"{state['stage']}.safetensors"
    if dest.exists():
        raise FileExistsError(f"{dest} exists: pick another --out (nothing was written)")
    cfg = config_from_dict(classes[state["stage"]], state["model_config"], str(ckpt))
    step = int(state["step"]) + int(state.get("curriculum_offset") or 0)
    save_release(dest, state["ema"], state["stage"], cfg,
                 dict(step=step, run=str(run), exported_mid_run=True, run_step=int(state["step"]),
                      wall_s=round(float(state.get("wall_s", 0.0)), 1), commit=git_commit()))
    return dict(file=str(dest), stage=state["stage"], step=step, run_step=int(state["step"]))
