"""In one process: how a batch goes through a real ``transformers`` model (keywords, a ModelOutput's logits,
a causal LM's labels shifted once, dict batches and their errors), how samples are collated, the batches
read ahead by worker processes, and the recipe switches (activation checkpointing, compile, early stop)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.data import ArrayDataset
from hpctrain.data.batches import collate
from hpctrain.data.datasets import as_dataset
from hpctrain.data.loading import PrefetchingReader
from hpctrain.errors import HpctrainError
from hpctrain.state import Progress
from hpctrain.training import recipes
from hpctrain.training.evaluation import score_batch
from hpctrain.training.losses import build_loss, forward

transformers = pytest.importorskip("transformers", reason="make setup installs transformers (hpctrain[hf])")
from hpctrain.models.huggingface import from_config, is_causal_lm  # noqa: E402

CE = build_loss("cross_entropy")


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    return from_config("GPT2LMHeadModel", vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).eval()


@pytest.fixture(scope="module")
def bert():
    torch.manual_seed(0)
    return from_config("BertForSequenceClassification", vocab_size=64, hidden_size=32, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=64, max_position_embeddings=32, num_labels=3,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).eval()


def stream_batch(seed=0):
    window = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(seed))
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def test_a_causal_lm_on_a_token_stream_learns_the_next_token_whichever_loss(gpt2):
    x, y = stream_batch()
    assert is_causal_lm(gpt2)
    own = forward(gpt2, (x, y), None)
    named = forward(gpt2, (x, y), CE)
    reference = F.cross_entropy(gpt2(input_ids=x).logits.reshape(-1, 64), y.reshape(-1))
    assert float(own.loss) == pytest.approx(float(reference), abs=1e-6)  # every target once, none shifted twice
    assert named.loss is None and float(CE(named.output, named.target)) == pytest.approx(float(reference), abs=1e-6)
    shifted_twice = F.cross_entropy(gpt2(input_ids=x).logits[:, :-1].reshape(-1, 64), y[:, 1:].reshape(-1))
    assert abs(float(own.loss) - float(shifted_twice)) > 1e-4  # what the equality above tells apart


def test_a_causal_lm_on_dict_batches_gets_its_labels_as_they_are(gpt2):
    x, _ = stream_batch(1)
    out = forward(gpt2, {"input_ids": x, "labels": x}, None)
    assert float(out.loss) == pytest.approx(float(gpt2(input_ids=x, labels=x).loss), abs=1e-6)
    # scored position by position: the next token, the last position not at all
    assert out.target[:, :-1].tolist() == x[:, 1:].tolist() and (out.target[:, -1] == -100).all()
    scores = score_batch(out.output.float(), out.target, CE, loss=out.loss, samples=out.samples)
    assert scores["accuracy"][1] == 4 * 15 and scores["loss"][1] == 4


def test_a_classifier_from_dict_batches_with_an_attention_mask(bert):
    ids = torch.randint(0, 64, (3, 10))
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    labels = torch.tensor([0, 2, 1])
    own = forward(bert, {"input_ids": ids, "attention_mask": mask, "labels": labels}, None)
    expected = bert(input_ids=ids, attention_mask=mask, labels=labels)
    assert float(own.loss) == pytest.approx(float(expected.loss), abs=1e-6)
    named = forward(bert, {"input_ids": ids, "attention_mask": mask, "labels": labels}, CE)
    assert torch.equal(named.output, expected.logits) and torch.equal(named.target, labels)


@pytest.mark.parametrize("batch, loss, said", [
    ({"input_ids": torch.zeros(2, 4, dtype=torch.long), "text": ["a", "b"], "labels": torch.zeros(2, dtype=torch.long)},
     None, "key(s) 'text' that BertForSequenceClassification.forward does not take"),
    ({"input_ids": torch.zeros(2, 4, dtype=torch.long)}, CE, "needs targets, but the batch has no 'labels' key"),
    ({"input_ids": torch.zeros(2, 4, dtype=torch.long)}, None, "returned no loss"),
])
def test_dict_batches_the_model_cannot_take_are_named(bert, batch, loss, said):
    with pytest.raises(HpctrainError, match="HINT") as err:
        forward(bert, batch, loss)
    assert said in str(err.value)


def test_a_model_loss_for_a_forward_without_targets_is_named():
    with pytest.raises(HpctrainError, match="Linear.forward takes no targets"):
        forward(nn.Linear(3, 2), (torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)), None)


def test_collation_of_pairs_dicts_and_lengths_that_need_padding():
    x, y = collate([(np.ones(3), 1), (np.zeros(3), 2)])
    assert x.shape == (2, 3) and y.tolist() == [1, 2]
    batch = collate([{"ids": [1, 2], "labels": 0, "text": "a"}, {"ids": [3, 4], "labels": 1, "text": "b"}])
    assert batch["ids"].tolist() == [[1, 2], [3, 4]] and batch["text"] == ["a", "b"]
    with pytest.raises(HpctrainError, match="different shapes in one batch.*\n.*data.collate"):
        collate([{"ids": [1, 2]}, {"ids": [3]}])
    with pytest.raises(HpctrainError, match="data.collate = 'm:f' raised ZeroDivisionError"):
        collate([1], fn=lambda s: 1 / 0, spec="m:f")
    padded = as_dataset([{"ids": [1]}, {"ids": [2, 3]}], "").data  # the dataset is kept as given
    assert len(padded) == 2


class Slow:
    """A map-style dataset whose __getitem__ costs time and records the process that read it."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        import os

        return {"x": [float(i)] * 4, "labels": i, "pid": [os.getpid()]}


def test_workers_read_what_the_rank_would_have_read_in_its_order():
    import os

    data = as_dataset(Slow())
    reader = PrefetchingReader(data, workers=2, prefetch=2)
    plan = [np.array([3, 1, 2]), np.array([9, 8]), np.array([0, 63, 5])]
    reader.plan(plan, epoch=0, position=0)
    try:
        read = [reader.read(i) for i in plan]
        assert [b["labels"].tolist() for b in read] == [[3, 1, 2], [9, 8], [0, 63, 5]]
        assert all(int(p) != os.getpid() for b in read for p in b["pid"].reshape(-1))  # by the workers
        direct = reader.read(np.array([7]))  # not planned: read here
        assert direct["labels"].tolist() == [7] and int(direct["pid"][0, 0]) == os.getpid()
        assert reader.direct_reads == 1
        reader.plan(plan[1:], epoch=1, position=3)  # the next epoch, from the same workers
        assert reader.read(plan[1])["labels"].tolist() == [9, 8]
    finally:
        reader.close()


def test_workers_bound_to_the_rank_s_one_core_are_told_how_to_give_them_cores():
    """mpirun binds a rank to one core and forked workers inherit it: the first lines say so and what to do."""
    import os

    reader = PrefetchingReader(as_dataset(Slow()), workers=2, prefetch=3)
    everywhere = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(everywhere)})  # as under mpirun's binding
    try:
        bound = reader.describe()
    finally:
        os.sched_setaffinity(0, everywhere)
    assert bound.startswith("data: 2 worker processes per rank, 3 batches ahead each; they share this rank's 1 core")
    assert "mpirun --map-by slot:PE=3, srun --cpus-per-task=3) or set data.workers = 0" in bound
    if len(everywhere) >= 2:  # one worker beside the step, with a core of its own: nothing to advise
        assert PrefetchingReader(as_dataset(Slow()), workers=1).describe() == \
            "data: 1 worker process per rank, 2 batches ahead each"


def test_an_error_in_a_worker_is_said_in_one_line():
    class Broken(Slow):
        def __getitem__(self, i):
            raise KeyError(f"sample {i} is missing")

    reader = PrefetchingReader(as_dataset(Broken()), workers=1)
    reader.plan([np.array([4])])
    try:
        with pytest.raises(HpctrainError, match=r"raised KeyError: 'sample 4 is missing' \(at .*\) \(in a data worker"):
            reader.read(np.array([4]))
    finally:
        reader.close()


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.2)) for _ in range(3)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def grads(model, x):
    torch.manual_seed(1)
    model.zero_grad()
    model(x).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_activation_checkpointing_recomputes_each_block_with_the_same_gradients():
    x = torch.randn(5, 8)
    plain, checkpointed = Blocks(), Blocks()
    said = recipes.checkpoint_activations(checkpointed)
    assert "each of 5 top-level blocks of Blocks" in said
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()
    a, b = grads(plain, x), grads(checkpointed, x)
    assert all(torch.equal(a[n], b[n]) for n in a)  # dropout draws the same in the recomputation


def test_activation_checkpointing_of_a_transformers_model_is_its_own(gpt2):
    model = from_config("GPT2LMHeadModel", vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    assert "GPT2LMHeadModel's own" in recipes.checkpoint_activations(model)
    assert model.is_gradient_checkpointing


def test_a_compiled_model_keeps_its_names_and_goes_back_to_eager():
    model = Blocks()
    names = list(model.state_dict())
    recipes.compile_model(model)
    assert recipes.is_compiled(model) and list(model.state_dict()) == names
    recipes.uncompile(model)
    assert not recipes.is_compiled(model)


def test_early_stop_counts_evaluations_without_improvement_once_per_step():
    stop, progress = recipes.EarlyStop(2, "val_loss", "min"), Progress(seed=0)
    seen = []
    for step, loss in [(1, 3.0), (2, 2.0), (2, 2.0), (3, 2.5), (4, 1.0), (5, 1.5), (6, float("nan"))]:
        progress.step = step
        seen.append(stop.update(progress, {"val_loss": loss}))
    assert seen[:6] == [None] * 6  # step 2 counted once; step 4 improved
    assert seen[6] == {"step": 6, "metric": "val_loss", "best": 1.0, "best_step": 4, "evaluations": 2, "patience": 2}
    higher = recipes.EarlyStop(1, "val_accuracy", "max")
    progress.extra.clear()
    progress.step = 1
    assert higher.update(progress, {"val_accuracy": 0.5}) is None
    progress.step = 2
    assert higher.update(progress, {"val_accuracy": 0.4})["best"] == 0.5


def test_array_datasets_still_read_pairs():
    x, y = ArrayDataset(np.ones((4, 2)), np.arange(4)).read([2, 0])
    assert y.tolist() == [2, 0]
