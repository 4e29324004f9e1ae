"""Policies that act on gym-pusht's observations (`obs["pixels"]`, `obs["agent_pos"]`), usable as
`iws eval policy --policy iws_gym.policies:NAME`: scripted frame-only pushers and the shipped
behaviour-cloning policies of the evaluation suite."""
from iws_gym.policies.scripted import (  # noqa: F401
    FramePusher, IdlePolicy, JitteryPusher, LazyPusher, RandomPolicy, bc_step300, bc_step1000, bc_step4000, suite,
)
