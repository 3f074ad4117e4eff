"""Linear probes (scikit-learn logistic regression, not private) on three features of the pretrained
all-MiniLM-L6-v2 for rotten-tomatoes-512: the [CLS] token's last hidden state, the pooler's output on it (what
AutoModelForSequenceClassification's head reads: `minilm-cls`), and the mean over real tokens (the sentence
embedding the checkpoint was trained to give: `minilm`). Saves the features to /tmp/sw/feats.pt for
dp_probe.py. Run from the repository root: `.venv/bin/python experiments/results/defaults_matrix/text_features/features.py`;
output: features.txt."""
import torch, time
from dpopt.data.datasets import load_dataset
from dpopt.models import build_model
torch.set_num_threads(2)
data = load_dataset("rotten-tomatoes-512")
m = build_model("minilm-cls", data).eval()
print({n: p.shape for n, p in m.named_parameters() if "pooler" in n or "classifier" in n})
def feats(d):
    cls, mean, pool = [], [], []
    with torch.no_grad():
        for i in range(0, len(d["labels"]), 128):
            ids, am = d["input_ids"][i:i+128], d["attention_mask"][i:i+128]
            out = m.bert(input_ids=ids, attention_mask=am)
            h = out.last_hidden_state
            cls.append(h[:, 0]); pool.append(out.pooler_output)
            mk = am.unsqueeze(2).float(); mean.append((h*mk).sum(1)/mk.sum(1))
    return torch.cat(cls), torch.cat(mean), torch.cat(pool)
t=time.time()
tr = feats(data.train); te = feats(data.test)
print("feature time", time.time()-t, len(data.train["labels"]), len(data.test["labels"]))
import os; os.makedirs("/tmp/sw", exist_ok=True)
torch.save(dict(tr=tr, te=te, ytr=data.train["labels"], yte=data.test["labels"]), "/tmp/sw/feats.pt")
from sklearn.linear_model import LogisticRegression
for name, a, b in zip(["cls", "mean", "pooler"], tr, te):
    for C in (0.1, 1, 10):
        clf = LogisticRegression(C=C, max_iter=2000).fit(a.numpy(), data.train["labels"].numpy())
        print(name, C, clf.score(b.numpy(), data.test["labels"].numpy()), "norm", a.norm(dim=1).mean().item())
