"""Policies that act on gym-pusht's observations (`obs["pixels"]`, `obs["agent_pos"]`), usable as
`iws eval policy --policy iws_gym.policies:NAME`: scripted frame-only pushers and the shipped
behaviour-cloning policies of the evaluation suite, and the visuomotor policy (`visuomotor`); the
pile-sweeping policies in `sweepers.py`. `task_suite(task)` is each task's graded suite of `iws eval correlate`."""
from iws_gym.policies.scripted import (  # noqa: F401
    ExpertPusher, FramePusher, IdlePolicy, JitteryPusher, LazyPusher, MarkovExpertPusher, RandomPolicy,
    bc_step300, bc_step1000, bc_step4000, suite,
)
from iws_gym.policies.visuomotor import visuomotor  # noqa: F401


SUITES = {"tpushing": "iws_gym.policies.scripted:suite", "pilesweeping": "iws_gym.policies.sweepers:suite"}


def task_suite(task: str) -> dict:
    """The graded policy suite of a task (name -> factory), from doing nothing to its competent demonstrator."""
    import importlib

    if task not in SUITES:
        raise ValueError(f"no policy suite for task {task!r}; suites: {', '.join(SUITES)}")
    mod_name, attr = SUITES[task].split(":")
    return getattr(importlib.import_module(mod_name), attr)()


POLICY_KINDS = {"visuomotor": "iws_gym.policies.visuomotor:VisuomotorPolicy", "bc": "iws_gym.policies.bc:BCPolicy"}


def load_policy_factory(spec: str):
    """MODULE:CALLABLE or a policy's weights (FILE.safetensors, e.g. a checkpoint along `iws train-policy`)
    -> a zero-argument factory of policies. CALLABLE is a class, a factory marked `is_factory`, or a
    policy object / function (then shared by every episode)."""
    import importlib
    import inspect
    from pathlib import Path

    if spec.endswith(".safetensors"):
        from iws_gym.models.checkpoint import release_kind

        kind = release_kind(Path(spec))
        if kind not in POLICY_KINDS:
            raise ValueError(f"cannot load policy {spec!r}: it holds a {kind!r} model, not a policy ({', '.join(POLICY_KINDS)})")
        mod_name, attr = POLICY_KINDS[kind].split(":")
        cls = getattr(importlib.import_module(mod_name), attr)
        return lambda: cls(spec)

    if ":" not in spec:
        raise ValueError(f"--policy must be MODULE:CALLABLE, got {spec!r}")
    mod_name, attr = spec.split(":", 1)
    try:
        obj = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load policy {spec!r}: {e}") from None
    if inspect.isclass(obj):
        return obj
    if callable(obj) and getattr(obj, "is_factory", False):
        return obj
    return lambda: obj  # a plain function/object shared by every episode
