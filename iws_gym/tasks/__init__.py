"""Tasks: everything that knows a task's physics lives in its package here; the models know none of it.

A task is a config (iws_gym/envs/configs/<name>.toml) and a package. The config's `task_module` names the
module the task-generic layers (collection, held-out episodes, evaluation) call; it provides:

    make_env(frame_size)          the ground truth: a Gymnasium env with gym-pusht's conventions (obs dict of
                                  `pixels` and `agent_pos`, absolute agent targets, `reset_to_state`, info
                                  with `coverage` and `is_success`)
    STATE_SIZE, STATE_DOC         the length of the true state vector, and what its numbers are
    get_state(env), reset_state(env), render_state(state, frame_size, env=None)
                                  the true state vector the behaviours read, the vector that resets an env
                                  to where `env` is, and its frame drawn without stepping physics
    observe(env, info), step_record(info)
                                  what an episode file records with each observation and each step besides
                                  frames, agent position and action (data/episodes.py: ARRAYS)
    SEGMENT_NAMES, play_plan(rng, steps), MIXES, mix_plan(mix, seed, steps, learner), mix_of(plan)
                                  scripted behaviours: the play mix and the other `iws collect --mix` plans
    HELDOUT_BEHAVIOURS, heldout_plan(behaviour, seed, steps)
                                  the behaviours of held-out episodes (evaluation)
    READING_KEYS, readings(pred, ep), rerender(ep, horizon, frame_size), [WHOLE_RULE]
                                  what `iws eval fidelity` reads from predicted frames against an episode's
                                  true state (errors; NaN where nothing is found; a `*_whole` 0/1 array is
                                  object permanence), and the true states drawn again (the floor)
    success(coverage)             success per coverage value, as the ground truth decides it
    SCORE_DOC, second_scorer()    what `iws eval correlate` scores, and a second reader of the score from frames
                                  (or None); the task's graded policy suite is in iws_gym/policies (task_suite)
    checks()                      the frame checks of `iws eval stability` (its checks.py: frame statistics and
                                  their envelope, whole object, still-world drift)
    versions()                    versions of the ground truth, recorded with each collection

The success scorer (`scoring.py`'s protocol) is named by the config's `scorer`.

    pusht/       T pushing; ground truth gym-pusht (tpushing.toml)
    pilesweep/   pile sweeping; ground truth written here in pymunk (pilesweeping.toml)
"""
