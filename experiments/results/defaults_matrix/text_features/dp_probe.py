"""DP-SGD on the cached features of features.py (a linear head only, the encoder frozen): per-example
gradients of the softmax head in closed form, flat clip C, Poisson sampling at B/n, the noise multiplier from
`dpopt calibrate` for epsilon 2, delta 1e-5. A quick stand-in for `dpopt train --trainable` (the encoder is
frozen, so only the head's gradient is private), used to choose what to run for real; three secret seeds.
Output: dp_probe.txt."""
import torch, subprocess, json, math, itertools
torch.set_num_threads(1)
d = torch.load("/tmp/sw/feats.pt")
def sigma(q, steps):
    out = subprocess.run([".venv/bin/python","-m","dpopt.cli","calibrate","--epsilon","2","--delta","1e-5","--sample-rate",str(q),"--steps",str(steps),"--json"],capture_output=True,text=True).stdout
    return json.loads(out)["noise_multiplier"]
def run(which, B, epochs, lr, clip, adam=False, seed=0, normalize=False):
    X, Xt = d["tr"][which], d["te"][which]
    if normalize: X, Xt = torch.nn.functional.normalize(X, dim=1), torch.nn.functional.normalize(Xt, dim=1)
    y, yt = d["ytr"], d["yte"]
    n = len(y); q = B / n; T = round(epochs / q)
    s = sigma(q, T)
    g = torch.Generator().manual_seed(seed)
    W = torch.zeros(2, X.shape[1] + 1); m = torch.zeros_like(W); v = torch.zeros_like(W)
    Xa, Xta = torch.cat([X, torch.ones(n,1)],1), torch.cat([Xt, torch.ones(len(yt),1)],1)
    for t in range(T):
        idx = (torch.rand(n, generator=g) < q).nonzero().squeeze(1)
        p = torch.softmax(Xa[idx] @ W.T, 1); p[torch.arange(len(idx)), y[idx]] -= 1
        G = p.unsqueeze(2) * Xa[idx].unsqueeze(1)  # per example
        nrm = G.flatten(1).norm(dim=1).clamp_min(1e-12)
        G = (G * (clip / nrm).clamp(max=1).view(-1,1,1)).sum(0) + s * clip * torch.randn(W.shape, generator=g)
        G /= B
        if adam:
            m = 0.9*m + 0.1*G; v = 0.999*v + 0.001*G*G
            W -= lr * (m/(1-0.9**(t+1))) / ((v/(1-0.999**(t+1))).sqrt() + 1e-8)
        else:
            W -= lr * G
    return ((Xta @ W.T).argmax(1) == yt).float().mean().item(), s, T
names = {0: "cls", 1: "mean", 2: "pooler"}
for which in (0, 1, 2):
    for B, ep in ((128, 20), (256, 20), (512, 20), (1024,20)):
        for lr in (0.5, 2, 8):
            accs = [run(which, B, ep, lr, 1.0, seed=s)[0] for s in range(3)]
            print(names[which], "sgd B", B, "ep", ep, "lr", lr, [round(a*100,1) for a in accs], flush=True)
# the mean-pooled features at the recipes' default steps, raw and unit-norm (minilm normalises), five seeds
for norm in (False, True):
    for adam, lr in ((False, 0.5), (True, 0.15/160**0.5), (True, 0.03)):
        accs = [run(1, 128, 20, lr, 1.0, adam=adam, seed=s, normalize=norm)[0] for s in range(5)]
        print("mean norm", norm, "adam" if adam else "sgd", round(lr,4), [round(a*100,1) for a in accs], flush=True)
