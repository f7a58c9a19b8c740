#!/usr/bin/env python3
# Summarise a decode_1 trace written by `cuda_bench ... --trace FILE` (FILE + FILE.json): per-layer and
# per-stage durations (medians over blocks and layers), the last stage, the SM clock.
# Usage: python3 bench/cuda/trace_summary.py FILE   (e.g. a trace from ci/gpu/second-call.sh)
import json, struct, sys, statistics as st
f=sys.argv[1]; m=json.load(open(f+'.json')); B,L,N=m['blocks'],m['layers'],m['nstamp']
d=open(f,'rb').read(); t=struct.unpack('<%dQ'%(len(d)//8), d)
S=lambda b,l,k: t[(b*L+l)*N+k]
TAIL=(len(t)-B*L*N)//B  # 4 words per block (start, end, clock64 start, end); 2 in early traces
E=lambda b,k: t[B*L*N+b*TAIL+k]
t0=min(E(b,0) for b in range(B))
names=['S1 wait+stage x','QKV dot','att: poll q/k/v','att: compute','(3->5) partial poll','O combine+dot','S4 wait+stage x','gate/up dot','S5 wait h','down dot']
print('pos', m['pos'], 'blocks', B, 'kernel', (max(E(b,1) for b in range(B))-t0)/1e3, 'us')
print('layer 0 start (median block) after kernel start: %.2f us' % (st.median(S(b,0,0)-E(b,0) for b in range(B))/1e3))
per_layer=[st.median(S(b,l+1,0)-S(b,l,0) for b in range(B))/1e3 for l in range(L-1)]
print('per layer (median block): median %.2f us, min %.2f max %.2f' % (st.median(per_layer), min(per_layer), max(per_layer)))
natt=sum(1 for b in range(B) if S(b,1,3)!=0)
pairs=[(0,1),(1,2),(2,3),(3,4),(2,5),(5,6),(6,7),(7,8),(8,9),(9,10)]
for (a,b_),nm in zip(pairs,names):
    vals=[]
    for l in range(1,L):
        for b in range(B):
            if (a in (3,) or b_ in (3,4)) and S(b,l,3)==0: continue
            if a==2 and b_==5: pass
            vals.append((S(b,l,b_)-S(b,l,a))/1e3)
    vals.sort()
    print('%-24s median %.2f  p10 %.2f  p90 %.2f' % (nm, st.median(vals), vals[len(vals)//10], vals[len(vals)*9//10]))
# critical path: time from last producer finishing a stage to consumers' staged
for l in [5,15]:
    row=[]
    for k in range(11): row.append((st.median(S(b,l,k) for b in range(B))-S(0,l,0))/1e3)
    print('layer',l,'median stamps rel. block0 start:', ' '.join('%.2f'%x for x in row))
    row=[(max(S(b,l,k) for b in range(B) if S(b,l,k))-S(0,l,0))/1e3 for k in range(11)]
    print('layer',l,'max stamps   rel. block0 start:', ' '.join('%.2f'%x for x in row))
fin=[(E(b,1)-S(b,L-1,10))/1e3 for b in range(B)]
print('final (after last down -> end): median %.2f max %.2f' % (st.median(fin), max(fin)))
if TAIL == 4:
  clk=[(t[B*L*N+b*4+3]-t[B*L*N+b*4+2])/(E(b,1)-E(b,0)) for b in range(B)]
  print('SM clock (clock64 / globaltimer over the kernel): median %.3f GHz, min %.3f' % (st.median(clk), min(clk)))
