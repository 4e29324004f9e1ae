"""Drive the learned T-pushing world live with the keyboard or mouse, and record demonstrations.

    python examples/play.py --out data/demos            # shipped weights, 10 Hz, window 512x512

Keys: arrows / WASD move the agent target; drag with the mouse to set it directly (as in gym-pusht);
R starts recording, R again stops and saves the episode; X discards the recording; SPACE resets to a
new start; ESC or Q quits. The window shows the frame, FPS, coverage and the recording state.

Recordings are episode files in the project's dataset format (iws_gym/data/episodes.py), usable to train
policies or the model itself. Fields the learned world cannot know (true block pose, contacts) are
NaN / -1; `coverage` is the scorer's reading of each frame.

`--events FILE` replays scripted input ("<frame> <key>" lines, keys: left right up down r x space
quit), which is how the tests drive this script headless (SDL_VIDEODRIVER=dummy).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

KEY_STEP = 12.0  # px of the 512 canvas per frame while an arrow key is held


def parse_events(path):
    events = {}
    for line in Path(path).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            frame, key = line.split()
            events.setdefault(int(frame), []).append(key)
    return events


def save_recording(out: Path, rec: dict, seed: int, checkpoint=None) -> Path:
    from iws_gym.data.collect import git_commit
    from iws_gym.data.episodes import episode_path, write_episode, write_json_atomic
    from iws_gym.data.generate import world_model_identity
    from iws_gym.envs.registry import load_task

    out.mkdir(parents=True, exist_ok=True)
    existing = sorted(out.glob("ep_*.h5"))
    index = int(existing[-1].stem.split("_")[1]) + 1 if existing else 0
    T = len(rec["actions"])
    ep = dict(frames=np.stack(rec["frames"]), actions=np.stack(rec["actions"]), agent_pos=np.stack(rec["agent_pos"]),
              block_pose=np.full((T + 1, 3), np.nan), coverage=np.array(rec["coverage"]),
              n_contacts=np.full(T, -1), segments=np.full(T, -1))
    path = episode_path(out, index)
    write_episode(path, ep, dict(seed=seed, task="tpushing", segment_names=["teleop"], plan=f"teleop:{T}",
                                 source="examples/play.py (learned world)", generated=True))
    meta_path = out / "dataset.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else dict(
        task="tpushing", seed=seed, steps=None, frame_size=128, source="keyboard play in IWS-TPushing-v0", commit=git_commit(),
        generated=True, world_model=world_model_identity(checkpoint or load_task("tpushing").checkpoint_path))
    meta["episodes"] = index + 1
    write_json_atomic(meta_path, meta)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the shipped weights)")
    p.add_argument("--out", default="data/demos", help="where recorded episodes go")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fps", type=float, default=10.0, help="control rate (gym-pusht runs at 10 Hz)")
    p.add_argument("--events", default=None, help="scripted input file (tests, demos)")
    p.add_argument("--max-frames", type=int, default=None)
    args = p.parse_args(argv)

    import gymnasium as gym
    import pygame

    import iws_gym  # noqa: F401

    env = gym.make("IWS-TPushing-v0", checkpoint=args.checkpoint, render_mode=None).unwrapped
    obs, info = env.reset(seed=args.seed)
    pygame.init()
    screen = pygame.display.set_mode((512, 512))
    pygame.display.set_caption("iws-gym play: IWS-TPushing-v0")
    font = pygame.font.Font(None, 24)
    clock = pygame.time.Clock()
    events = parse_events(args.events) if args.events else {}
    target = np.array(obs["agent_pos"], dtype=np.float32)
    rec, dragging, frame_no, saved = None, False, 0, []
    held = set()
    fps_hist = []
    running = True
    while running:
        t0 = time.perf_counter()
        scripted = events.get(frame_no, [])
        for key in scripted:
            if key in ("left", "right", "up", "down"):
                held.symmetric_difference_update({key})  # scripted keys toggle held state
            else:
                pygame.event.post(pygame.event.Event(pygame.KEYDOWN, key={"r": pygame.K_r, "x": pygame.K_x,
                                  "space": pygame.K_SPACE, "quit": pygame.K_ESCAPE}[key]))
        for ev in pygame.event.get():
            if ev.type == pygame.QUIT:
                running = False
            elif ev.type == pygame.KEYDOWN:
                if ev.key in (pygame.K_ESCAPE, pygame.K_q):
                    running = False
                elif ev.key == pygame.K_r:
                    if rec is None:
                        rec = dict(frames=[obs["pixels"].copy()], actions=[], agent_pos=[obs["agent_pos"].copy()],
                                   coverage=[info.get("coverage", np.nan)])
                    else:
                        if rec["actions"]:
                            saved.append(str(save_recording(Path(args.out), rec, args.seed, args.checkpoint)))
                        rec = None
                elif ev.key == pygame.K_x:
                    rec = None
                elif ev.key == pygame.K_SPACE:
                    obs, info = env.reset()
                    target = np.array(obs["agent_pos"], dtype=np.float32)
                    rec = None
            elif ev.type == pygame.MOUSEBUTTONDOWN:
                dragging = True
            elif ev.type == pygame.MOUSEBUTTONUP:
                dragging = False
        if not running:
            break
        keys = pygame.key.get_pressed()
        dx = (keys[pygame.K_RIGHT] or keys[pygame.K_d] or "right" in held) - (keys[pygame.K_LEFT] or keys[pygame.K_a] or "left" in held)
        dy = (keys[pygame.K_DOWN] or keys[pygame.K_s] or "down" in held) - (keys[pygame.K_UP] or keys[pygame.K_w] or "up" in held)
        target = np.clip(target + KEY_STEP * np.array([dx, dy], np.float32), 0, 512)
        if dragging:
            target = np.clip(np.array(pygame.mouse.get_pos(), np.float32), 0, 512)  # the window is the 512 canvas
        obs, reward, terminated, truncated, info = env.step(target)
        if rec is not None:
            rec["actions"].append(target.copy())
            rec["frames"].append(obs["pixels"].copy())
            rec["agent_pos"].append(obs["agent_pos"].copy())
            rec["coverage"].append(info.get("coverage", np.nan))
        frame = np.kron(obs["pixels"], np.ones((4, 4, 1), np.uint8))  # 128 -> 512, nearest
        screen.blit(pygame.surfarray.make_surface(frame.swapaxes(0, 1)), (0, 0))
        fps_hist.append(time.perf_counter() - t0)
        fps = 1.0 / max(np.mean(fps_hist[-20:]), 1e-6)
        hud = f"model {fps:5.1f} FPS   coverage {info.get('coverage', 0):.2f}" + ("   REC" if rec is not None else "")
        screen.blit(font.render(hud, True, (200, 0, 0) if rec is not None else (0, 0, 0)), (8, 8))
        pygame.display.flip()
        clock.tick(args.fps)
        frame_no += 1
        if args.max_frames is not None and frame_no >= args.max_frames:
            break
    pygame.quit()
    env.close()
    print(json.dumps({"frames": frame_no, "saved": saved, "mean_model_fps": round(1.0 / max(np.mean(fps_hist), 1e-6), 1) if fps_hist else None}))
    return saved


if __name__ == "__main__":
    os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")
    main()
