"""The T block and the agent of gym-pusht, written once (gym-pusht's add_tee with scale 30, length 4).

Body frame of the block: origin at gym-pusht's body position, y down the stem. The T is the union of
two boxes, a bar on top and a stem below; everything else (polygons, outline, signed distance,
centroids, reach) is derived from them.
"""
from __future__ import annotations

import numpy as np

CANVAS = 512.0                 # gym-pusht's canvas, px
AGENT_RADIUS = 15.0
GOAL_POSE = np.array([256.0, 256.0, np.pi / 4])

# (centre x, centre y, half width, half height) in the body frame
BAR_BOX = (0.0, 15.0, 60.0, 15.0)
STEM_BOX = (0.0, 75.0, 15.0, 45.0)
T_BOXES = (BAR_BOX, STEM_BOX)


def _corners(box) -> np.ndarray:
    cx, cy, hx, hy = box
    return np.array([[cx - hx, cy + hy], [cx + hx, cy + hy], [cx + hx, cy - hy], [cx - hx, cy - hy]])


T_BAR, T_STEM = _corners(BAR_BOX), _corners(STEM_BOX)  # vertices (4, 2) of each part
# the outline of the union, counter-clockwise in image coordinates
T_OUTLINE = np.array([[-60, 0], [60, 0], [60, 30], [15, 30], [15, 120], [-15, 120], [-15, 30], [-60, 30]], float)
T_COG = np.array([0.0, 45.0])  # gym-pusht sets the centre of gravity to the mean of the two part centroids
_AREAS = [4 * hx * hy for _, _, hx, hy in T_BOXES]
# area centroid: what the mean of a pixel mask measures
T_AREA_CENTROID = np.array([0.0, sum(a * b[1] for a, b in zip(_AREAS, T_BOXES)) / sum(_AREAS)])
T_REACH = float(max(np.linalg.norm(T_OUTLINE, axis=1)))  # farthest point of the T from its body origin
T_AREA = float(sum(_AREAS))


def box_sdf(lx, ly, box):
    """Signed distance (px, negative inside) from body-frame points (lx, ly) to one box; elementwise on
    numpy arrays or torch tensors."""
    cx, cy, hx, hy = box
    qx, qy = abs(lx - cx) - hx, abs(ly - cy) - hy
    ox, oy = np.maximum(qx, 0), np.maximum(qy, 0)
    return np.sqrt(ox * ox + oy * oy) + np.minimum(np.maximum(qx, qy), 0)


def t_sdf_local(lx, ly):
    """Signed distance from body-frame points to the T."""
    return np.minimum(box_sdf(lx, ly, BAR_BOX), box_sdf(lx, ly, STEM_BOX))
