"""Real Hugging Face ``transformers`` models, unchanged, trained on 2 real ranks (mpirun): GPT-2 (tied
embeddings) from a token stream with the model's own loss and with a built-in one, exported with
``--format hf`` and scored by transformers itself; a Llama-style model (untied) killed mid-run and resumed bit
for bit; a BERT-style classifier from dict samples of different lengths (the README's examples as shipped, but
for their step budgets); the fine-tuning of exported weights named by ``AutoModelForCausalLM.from_pretrained``;
and bad input failing alike on every rank."""
import math
import re
import sys

import numpy as np
import pytest
import torch

from checkpoint_files import latest, tensors
from mpi_harness import ROOT, command, hpctrain, mpirun

transformers = pytest.importorskip("transformers", reason="make setup installs transformers (hpctrain[hf])")

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

SCRIPTS = ROOT / "tests" / "mpi"
STEPS = 12
BLOCK = 63
VAL = re.compile(r"done at step (\d+).* val_loss (\S+)")


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """train.bin and val.bin of examples/byte_gpt.py's corpus, smaller."""
    sys.path.insert(0, str(ROOT / "examples"))
    import byte_gpt

    return byte_gpt.prepare_tokens(str(tmp_path_factory.mktemp("tokens")), max_bytes=300_000, val_fraction=0.05)


def token_args(tokens, run_dir, *more):
    return [f"data.path={tokens}/train.bin", f"data.val_path={tokens}/val.bin", f"run.run_dir={run_dir}",
            "monitor.progress=log", f"train.max_steps={STEPS}", f"train.eval_every={STEPS}", "train.warmup_steps=2",
            "train.global_batch_size=16", "train.eval_batch_size=64",
            # a window of block_size + 1 tokens fits the 64 positions, so transformers scores the same targets
            f"data.block_size={BLOCK}", *more]


def done(output):
    step, val = VAL.search(output).groups()
    return int(step), float(val)


def hf_loss(model_dir, tokens, block=BLOCK):
    """transformers' own loss of a from_pretrained directory on every window of val.bin (as hpctrain cuts them)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    stream = np.fromfile(f"{tokens}/val.bin", dtype=np.uint16).astype(np.int64)
    windows = (len(stream) - block - 1) // block + 1
    rows = torch.as_tensor(np.stack([stream[i * block:i * block + block + 1] for i in range(windows)]))
    total = 0.0
    with torch.no_grad():
        for lo in range(0, windows, 64):
            batch = rows[lo:lo + 64]
            total += float(model(input_ids=batch, labels=batch).loss) * len(batch)
    return model, total / windows


def test_gpt2_trains_with_its_own_loss_or_a_named_one_and_exports_for_from_pretrained(tmp_path, tokens):
    """examples/hf_gpt2_tokens.toml: with loss = "model" and "cross_entropy" the same training (the targets are
    shifted once either way); its export loads with from_pretrained (tied embeddings still tied) and
    transformers' own loss on the validation windows is hpctrain's val_loss; then the exported weights are
    fine-tuned as examples/hf_finetune.toml names them, and exported again."""
    own = hpctrain(2, "train", "examples/hf_gpt2_tokens.toml", *token_args(tokens, tmp_path / "own"),
                   cwd=ROOT, timeout=300).check().output
    named = hpctrain(2, "train", "examples/hf_gpt2_tokens.toml", "train.loss=cross_entropy",
                     *token_args(tokens, tmp_path / "named"), cwd=ROOT, timeout=300).check().output
    (step, own_val), (_, named_val) = done(own), done(named)
    assert step == STEPS and own_val < math.log(256), own[-3000:]
    assert own_val == pytest.approx(named_val, abs=2e-3), (own_val, named_val)

    out = command("ckpt", "export", latest(tmp_path / "own"), "--to", tmp_path / "export", "--format", "hf",
                  cwd=ROOT).check().output
    assert "wrote GPT2LMHeadModel" in out, out
    model, theirs = hf_loss(tmp_path / "export", tokens)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    assert theirs == pytest.approx(own_val, abs=0.01), (theirs, own_val)

    tuned = hpctrain(2, "train", "examples/hf_finetune.toml",
                     f"model.kwargs.pretrained_model_name_or_path={tmp_path / 'export'}",
                     *token_args(tokens, tmp_path / "tuned"), "train.max_steps=4", "train.eval_every=4",
                     cwd=ROOT, timeout=300).check().output
    step, tuned_val = done(tuned)
    assert step == 4 and tuned_val < own_val + 0.05, tuned[-3000:]  # started from the export, not from scratch
    command("ckpt", "export", latest(tmp_path / "tuned"), "--to", tmp_path / "tuned-export", "--format", "hf",
            cwd=ROOT).check()
    assert hf_loss(tmp_path / "tuned-export", tokens)[1] == pytest.approx(tuned_val, abs=0.01)


LLAMA = ["model.factory=hpctrain.models.huggingface:from_config", "model.kwargs.architecture=LlamaForCausalLM",
         "model.kwargs.vocab_size=256", "model.kwargs.hidden_size=64", "model.kwargs.intermediate_size=128",
         "model.kwargs.num_hidden_layers=2", "model.kwargs.num_attention_heads=4", "model.kwargs.num_key_value_heads=2",
         "model.kwargs.max_position_embeddings=64", "model.kwargs.tie_word_embeddings=false",
         "checkpoint.every_steps=4"]


def test_llama_untied_killed_mid_run_resumes_bit_for_bit(tmp_path, tokens):
    """A Llama-style model (untied embeddings, the model's own loss) SIGKILLed on rank 1 in step 7 resumes from
    step 4 and ends with the very tensors of a run that was never killed; its export keeps the head untied."""
    whole = hpctrain(2, "train", "examples/hf_gpt2_tokens.toml", *LLAMA, *token_args(tokens, tmp_path / "whole"),
                     cwd=ROOT, timeout=300).check().output
    killed = mpirun(2, [SCRIPTS / "fail_inject.py", "-m", "hpctrain", "train", "examples/hf_gpt2_tokens.toml",
                        *LLAMA, *token_args(tokens, tmp_path / "parts")], cwd=ROOT, timeout=300, fresh=True,
                    env={"FAIL_RANK": "1", "FAIL_AT": "backward:7", "FAIL_ACTION": "kill"})
    assert killed.returncode != 0, killed.output[-3000:]
    resumed = hpctrain(2, "train", "examples/hf_gpt2_tokens.toml", *LLAMA, *token_args(tokens, tmp_path / "parts"),
                       cwd=ROOT, timeout=300).check().output
    assert re.search(r"resumed from \S+ckpt-0*4.h5 at step 4", resumed), resumed[-3000:]
    assert done(resumed) == done(whole)
    a, b = tensors(latest(tmp_path / "whole")), tensors(latest(tmp_path / "parts"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), "resumed tensors differ"

    command("ckpt", "export", latest(tmp_path / "parts"), "--to", tmp_path / "export", "--format", "hf",
            cwd=ROOT).check()
    model, theirs = hf_loss(tmp_path / "export", tokens)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert theirs == pytest.approx(done(resumed)[1], abs=0.01)


def test_classifier_from_dict_samples_padded_per_batch_read_by_workers(tmp_path):
    """examples/hf_classifier.toml: dict samples of different lengths, padded by its collate function, read by 2
    worker processes per rank: the same run as with none; the export loads as a sequence classifier that
    scores the validation set as hpctrain did."""
    common = ["examples/hf_classifier.toml", "monitor.progress=log", "train.max_steps=30", "train.eval_every=30",
              "data.kwargs.train_samples=1024", "data.kwargs.val_samples=128"]
    read_ahead = hpctrain(2, "train", *common, f"run.run_dir={tmp_path / 'workers'}", cwd=ROOT,
                          timeout=300).check().output
    inline = hpctrain(2, "train", *common, "data.workers=0", f"run.run_dir={tmp_path / 'inline'}", cwd=ROOT,
                      timeout=300).check().output
    assert done(read_ahead) == done(inline), (read_ahead[-1500:], inline[-1500:])
    accuracy = float(re.search(r"done at step 30.* val_accuracy (\S+)", read_ahead).group(1))

    command("ckpt", "export", latest(tmp_path / "workers"), "--to", tmp_path / "export", "--format", "hf",
            cwd=ROOT).check()
    sys.path.insert(0, str(ROOT / "examples"))
    import hf_data

    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "export")).eval()
    _, val = hf_data.snippets(train_samples=1024, val_samples=128)
    batch = hf_data.pad([val[i] for i in range(len(val))])
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert float((logits.argmax(-1) == batch["labels"]).float().mean()) == pytest.approx(accuracy, abs=1e-4)  # as printed


HFBAD = """
import hf_data

def with_text(train_samples, val_samples):
    train, val = hf_data.snippets(train_samples, val_samples)
    for s in train.samples + val.samples:  # one length (no padding needed), and a column the model lacks
        s["input_ids"], s["attention_mask"], s["text"] = s["input_ids"][:16], s["attention_mask"][:16], "a snippet"
    return train, val

def raises(samples):
    raise ValueError("no padding today")
"""

BAD = [
    # (overrides of examples/hf_classifier.toml, what every rank says)
    (["data.factory=hfbad:with_text", "data.collate="],
     "key(s) 'text' that BertForSequenceClassification.forward does not take"),
    (["data.collate=hfbad:raises"], "data.collate = 'hfbad:raises' raised ValueError: no padding today"),
    (["data.collate="], "samples' input_ids have different shapes in one batch"),
    (["data.workers=-1"], "data.workers = -1 must be >= 0"),
]


def fails_alike_on_every_rank(result, said, where):
    """Every rank exits 2 (rank 0 says why, once), no traceback, no checkpoint."""
    assert result.returncode == 2 and said in result.stderr and "HINT:" in result.stderr, result.output[-3000:]
    assert "Traceback" not in result.output, result.output[-3000:]
    assert not list(where.glob("**/ckpt-*.h5")), "a checkpoint was written"


@pytest.mark.parametrize("overrides, said", BAD, ids=["unknown-key", "collate-raises", "no-collate", "workers"])
def test_bad_dict_data_fails_alike_on_every_rank(tmp_path, overrides, said):
    (tmp_path / "hfbad.py").write_text(HFBAD)
    result = hpctrain(2, "train", "examples/hf_classifier.toml", "data.kwargs.train_samples=256",
                      "data.kwargs.val_samples=64", f"run.root={tmp_path}",
                      f'run.python_path=["{tmp_path}", "examples"]', *overrides, cwd=ROOT, timeout=120)
    fails_alike_on_every_rank(result, said, tmp_path)


def test_the_model_loss_for_a_model_that_takes_no_targets(tmp_path, digits):
    result = hpctrain(2, "train", "examples/digits.toml", f"data.path={digits}", "train.loss=model",
                      f"run.root={tmp_path}", cwd=ROOT, timeout=120)
    fails_alike_on_every_rank(result, "Sequential.forward takes no targets", tmp_path)


def test_export_hf_of_a_model_that_is_not_a_transformers_one(tmp_path, digits):
    hpctrain(2, "train", "examples/digits.toml", f"run.run_dir={tmp_path / 'run'}", f"data.path={digits}",
             "train.max_steps=2", cwd=ROOT, timeout=120).check()
    out = command("ckpt", "export", latest(tmp_path / "run"), "--to", tmp_path / "x", "--format", "hf", cwd=ROOT)
    assert out.returncode == 2 and "is not a transformers model" in out.output and "Traceback" not in out.output
    assert not (tmp_path / "x").exists()
