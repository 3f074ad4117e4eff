"""The cached embeddings of features.py (/tmp/sw/feats.pt), mean-pooled and L2-normalised as minilm embeds, saved as a
datasets.DatasetDict (train: the 1,024 training snippets, test: the 2,562 test snippets) for `dpopt train --dataset
/tmp/sw/rt_mean --model logreg`: the head of rotten-tomatoes-512/minilm without its encoder (and without dropout)."""
import torch, datasets
d = torch.load("/tmp/sw/feats.pt")
def split(X, y):
    X = torch.nn.functional.normalize(X, dim=1)
    cols = {f"f{i}": X[:, i].tolist() for i in range(X.shape[1])}
    cols["label"] = y.tolist()
    return datasets.Dataset.from_dict(cols)
dd = datasets.DatasetDict(train=split(d["tr"][1], d["ytr"]), test=split(d["te"][1], d["yte"]))
dd.save_to_disk("/tmp/sw/rt_mean")
