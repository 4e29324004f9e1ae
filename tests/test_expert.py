"""The planning expert (tasks/pusht/expert.py): its private physics is gym-pusht's, and it finishes a push."""
import json

import numpy as np

from .conftest import run_iws


def test_private_physics_steps_exactly_like_gym_pusht():
    from iws_gym.tasks.pusht.expert import _Physics
    from iws_gym.tasks.pusht.groundtruth import get_state, make_env

    env = make_env(128)
    env.reset(options={"reset_to_state": np.array([200.0, 300.0, 260.0, 250.0, 0.3])})
    sim = _Physics()
    s = get_state(env)
    sim.set(s[:2], np.array(env.agent.velocity), s[2:])
    for a in ([260, 260], [280, 250], [300, 240], [300, 240]):  # into the block: contact and a push
        env.step(np.array(a, float))
        sim.step(a)
    agent, _, block = sim.get()
    true = get_state(env)
    assert np.abs(true[:2] - agent).max() < 1e-6 and np.abs(true[2:4] - block[:2]).max() < 1e-6
    assert abs(np.angle(np.exp(1j * (true[4] - block[2])))) < 1e-6
    assert np.abs(true[2:] - [260.0, 250.0, 0.3]).max() > 1.0  # the block was pushed


def test_expert_finishes_a_push_from_a_displaced_start():
    """From a block 60 px and 0.5 rad off the goal, the expert (true state) reaches success well within 300
    steps, and its actions are valid targets."""
    from iws_gym.tasks.pusht.expert import PlanningPusher, pose_error
    from iws_gym.tasks.pusht.groundtruth import get_state, make_env

    env = make_env(128)
    env.reset(options={"reset_to_state": np.array([100.0, 400.0, 300.0, 300.0, np.pi / 4 + 0.5])})
    pol = PlanningPusher(rng=np.random.default_rng(0))
    start = pose_error(get_state(env)[2:])
    for _ in range(300):
        a = pol.act(get_state(env))
        assert a.shape == (2,) and np.all((a >= 0) & (a <= 512))
        _, _, done, _, info = env.step(a)
        if done:
            break
    assert info["is_success"] and info["coverage"] > 0.95 and start > 50


def test_frame_expert_and_ground_truth_only_evaluation(tmp_path):
    """The expert reading the pose from frames runs through `iws eval policy --ground-truth-only`, which needs
    no weights and reports gym-pusht alone."""
    out = tmp_path / "e.json"
    run_iws("eval", "policy", "--policy", "iws_gym.policies:ExpertPusher", "--ground-truth-only", "--episodes", 1,
            "--horizon", 20, "--json", out)
    r = json.loads(out.read_text())
    assert "learned" not in r and r["ground_truth"]["episodes"] == 1 and 0 <= r["ground_truth"]["scores"][0] <= 1


def test_collect_expert_mix_ends_each_demonstration_at_success(tmp_path):
    """`iws collect --mix expert` records the planning expert; an episode stops at success (a start near the
    goal finishes within the step budget) and says which mix it is."""
    from iws_gym.data.collect import SEGMENT_NAMES, collect_episode, episode_plan, mix_of
    from iws_gym.envs.registry import load_task

    task = load_task("tpushing")
    lengths = []
    for seed in range(40):  # a handful of starts; the near ones finish fast
        ep = collect_episode(task, seed, 120, plan=episode_plan("expert", seed, 120))
        n = len(ep["actions"])
        assert len(ep["frames"]) == n + 1 and set(ep["segments"].tolist()) == {SEGMENT_NAMES.index("expert")}
        assert ep["plan"] == [("expert", n)] and mix_of(f"expert:{n}") == "expert"
        lengths.append(n)
        if n < 120:
            assert ep["coverage"][-1] > 0.95 and (ep["coverage"][:-1] <= 0.95).all()
            break
    assert min(lengths) < 120
    ep = collect_episode(task, 0, 20, plan=episode_plan("expert_markov", 0, 20))  # the Markov expert's demonstrations
    assert ep["plan"] == [("expert_markov", 20)] and mix_of("expert_markov:20") == "expert_markov"
    assert set(ep["segments"].tolist()) == {SEGMENT_NAMES.index("expert_markov")}


def test_markov_expert_continues_a_push_and_plans_from_the_state_alone():
    """reach: right after a push, beside the contact, the next plan starts next to the block instead of first
    backing off to the orbit (~105 px from the T's centre), which replanning mid-push would repeat forever.
    replan_every: every N actions it plans afresh, so two experts with different pasts, at the same state and
    last position, act the same; and it still finishes a push when replanning every 8 steps."""
    from iws_gym.tasks.pusht.expert import MARKOV, PlanningPusher
    from iws_gym.tasks.pusht.geometry import T_COG
    from iws_gym.tasks.pusht.groundtruth import get_state, make_env, rot

    env = make_env(96)
    env.reset(options={"reset_to_state": np.array([100.0, 400.0, 300.0, 300.0, np.pi / 4 + 0.5])})
    first = PlanningPusher(rng=np.random.default_rng(0))
    while True:  # the first push, until it has ended in contact with the block
        _, _, _, _, info = env.step(first.act(get_state(env)))
        if not first.plan and info["n_contacts"] > 0:
            break
    s = get_state(env)
    cog = s[2:4] + rot(s[4]) @ T_COG
    far = {}
    for reach in (0.0, MARKOV["reach"]):
        p = PlanningPusher(rng=np.random.default_rng(1), reach=reach)
        p.act(s)
        far[reach] = max(np.linalg.norm(np.asarray(a) - cog) for a in p.plan[:6])
    assert far[0.0] > 100 > far[MARKOV["reach"]]
    a, b = PlanningPusher(rng=np.random.default_rng(2), **MARKOV), PlanningPusher(rng=np.random.default_rng(2), **MARKOV)
    for _ in range(MARKOV["replan_every"]):  # a acts from another state first; b only sees the last position
        a.act(s + [30.0, -20.0, 0, 0, 0])
    a.last_agent = s[:2] - [3.0, 1.0]
    b.last_agent, b.steps = s[:2] - [3.0, 1.0], MARKOV["replan_every"]
    assert np.array_equal(a.act(s), b.act(s)) and [list(x) for x in a.plan] == [list(x) for x in b.plan]
    env.reset(options={"reset_to_state": np.array([100.0, 400.0, 300.0, 300.0, np.pi / 4 + 0.5])})
    m = PlanningPusher(rng=np.random.default_rng(0), **MARKOV)
    for _ in range(300):
        _, _, done, _, info = env.step(m.act(get_state(env)))
        if done:
            break
    assert info["is_success"]
