"""Reconstructions of the compact stage 1 (real frames above, decoded below) and the T's pose change between
them as read by the pose reader.  python scripts/compact_latent/recon.py RUN OUT.png"""
import sys; sys.path.insert(0,'scratch')
import torch, numpy as np
from pathlib import Path
from compact_dyn import load_ae
from iws_gym.data.episodes import read_episode, list_episodes
from iws_gym.evaluation.fidelity import save_grid
from iws_gym.tasks.pusht.pose import estimate
enc,dec,D=load_ae(sys.argv[1])
ps=list_episodes('data/play_expert')
rows=[]
errs=[]
for i in (5, 700, 900, 1050, 300):
    e=read_episode(ps[i],['frames','agent_pos','block_pose'])
    s=max(1,len(e['frames'])//8)
    f=e['frames'][::s][:8]
    x=torch.from_numpy(f).permute(0,3,1,2).float()/127.5-1
    with torch.no_grad(): y=dec(enc(x),torch.from_numpy(e['agent_pos'][::s][:8]/512).float())
    r=((y.clamp(-1,1)+1)*127.5).round().byte().permute(0,2,3,1).numpy()
    if i < 800: rows+=[f,r]
    for a,b,bp in zip(f,r,e['block_pose'][::s][:8]):
        ea,eb=estimate(a),estimate(b)
        if ea.block is not None and eb.block is not None: errs.append(np.linalg.norm(ea.block[:2]-eb.block[:2]))
save_grid(rows,Path(sys.argv[2]),scale=1)
print('pose diff recon vs real px median',np.median(errs),np.max(errs), len(errs))
