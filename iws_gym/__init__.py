"""iws-gym: a learned robot simulator (Interactive World Simulator) served as a Gymnasium environment.

Importing the package registers the task ids (Gymnasium >= 1.0 has no plugin discovery);
`gym.make("iws_gym:IWS-TPushing-v0")` also works without a prior import.
"""
from gymnasium.envs.registration import register, registry

__version__ = "0.1.0"

if "IWS-TPushing-v0" not in registry:
    register(id="IWS-TPushing-v0", entry_point="iws_gym.envs.env:WorldSimEnv",
             vector_entry_point="iws_gym.envs.vector_env:WorldSimVectorEnv", max_episode_steps=300,
             kwargs={"task": "tpushing"})
if "IWS-PileSweeping-v0" not in registry:  # its weights: checkpoints/pilesweeping
    register(id="IWS-PileSweeping-v0", entry_point="iws_gym.envs.env:WorldSimEnv",
             vector_entry_point="iws_gym.envs.vector_env:WorldSimVectorEnv", max_episode_steps=400,
             kwargs={"task": "pilesweeping"})
if "iws_gym/PileSweepPymunk-v0" not in registry:  # the ground truth of pile sweeping (tasks/pilesweep)
    register(id="iws_gym/PileSweepPymunk-v0", entry_point="iws_gym.tasks.pilesweep.groundtruth:PileSweepEnv",
             max_episode_steps=400, kwargs={"obs_type": "state"})


def __getattr__(name):  # lazy exports keep `import iws_gym` light
    if name == "WorldModel":
        from iws_gym.models.world_model import WorldModel

        return WorldModel
    if name == "WorldSimEnv":
        from iws_gym.envs.env import WorldSimEnv

        return WorldSimEnv
    raise AttributeError(name)
