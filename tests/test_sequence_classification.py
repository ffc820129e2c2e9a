"""`AutoDistributedModelForSequenceClassification` and `AutoDistributedModel` (issue: PETALS' classes).

In-process spans loaded from a `*ForSequenceClassification` checkpoint give transformers' logits and
losses (LLaMA-GQA and BLOOM; one sequence, left- and right-padded batches) and `AutoModel`'s hidden
states; a few Adam steps on the head and deep prompts lower the loss; bad input is refused clearly.
Two real servers (one holding the causal checkpoint's blocks, one the classification checkpoint's)
give the same logits, and the same loss and gradients as local blocks through the backward RPC.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel, AutoModelForSequenceClassification

from llm_swarm.client import (
    AutoDistributedModel,
    AutoDistributedModelForSequenceClassification,
    DistributedModelForSequenceClassification,
)
from llm_swarm.client.backend import LocalSpans
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.models import load_span
from llm_swarm.swarm.models.tiny import PAD_ID
from tests.conftest import NUM_BLOCKS

NUM_LABELS = 3
ONE = torch.tensor([[5, 17, 99, 200, 33, 41]])
LEFT_PADDED = torch.tensor([[5, 17, 99, 200, 33, 41], [PAD_ID, PAD_ID, PAD_ID, 8, 9, 10]])
RIGHT_PADDED = torch.tensor([[5, 17, 99, 200, 33, 41], [8, 9, 10, 11, PAD_ID, PAD_ID]])
BATCHES = {"one": ONE, "left-padded": LEFT_PADDED, "right-padded": RIGHT_PADDED}
# a toy task for the training steps: four sequences, each with its own label
TRAIN_IDS = torch.tensor([[5, 17, 99, 200], [8, 9, 10, 11], [40, 41, 42, 43], [70, 3, 70, 3]])
TRAIN_LABELS = torch.tensor([0, 1, 2, 1])


def save_classifier(causal_dir, out_dir):
    """A `*ForSequenceClassification` checkpoint from a causal one (its new head seeded), sharded."""
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(causal_dir, num_labels=NUM_LABELS)
    model.save_pretrained(out_dir, max_shard_size="60KB")
    return out_dir


@pytest.fixture(scope="module", params=["llama", "bloom"])
def dirs(request, llama_dir, bloom_dir, tmp_path_factory):
    """(causal checkpoint, classification checkpoint) of one family."""
    causal = llama_dir if request.param == "llama" else bloom_dir
    return causal, save_classifier(causal, tmp_path_factory.mktemp(f"{request.param}-cls") / "model")


@pytest.fixture(scope="module")
def classifiers(dirs):
    """transformers' model and ours over two in-process spans read from the classification checkpoint
    (servers load their spans from such a checkpoint as from a causal one)."""
    _causal, cls_dir = dirs
    reference = AutoModelForSequenceClassification.from_pretrained(cls_dir).eval()
    backend = LocalSpans([load_span(cls_dir, 0, 2)[0], load_span(cls_dir, 2, NUM_BLOCKS)[0]])
    return reference, AutoDistributedModelForSequenceClassification.from_local_parts(cls_dir, backend)


def local_backend(model_dir) -> LocalSpans:
    return LocalSpans([load_span(model_dir, 0, NUM_BLOCKS)[0]])


def local_classifier(model_dir, **kwargs) -> DistributedModelForSequenceClassification:
    return DistributedModelForSequenceClassification.from_local_parts(
        model_dir, local_backend(model_dir), **kwargs
    )


@pytest.mark.parametrize("batch", list(BATCHES))
def test_logits_and_loss_equal_transformers(classifiers, batch):
    reference, model = classifiers
    ids = BATCHES[batch]
    mask = (ids != PAD_ID).long()
    labels = torch.tensor([2, 0])[: ids.shape[0]]
    expected = reference(input_ids=ids, attention_mask=mask, labels=labels)
    output = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert output.logits.shape == (ids.shape[0], NUM_LABELS)
    assert torch.allclose(output.logits, expected.logits, atol=1e-4)
    assert abs(output.loss.item() - expected.loss.item()) < 1e-4
    # the head's gradient: the same loss, differentiated the same way
    expected.loss.backward()
    output.loss.backward()
    assert torch.allclose(model.score.weight.grad, reference.score.weight.grad, atol=1e-4)
    model.score.weight.grad = reference.score.weight.grad = None


def test_multi_label_and_regression_losses_equal_transformers(classifiers):
    """The loss follows `problem_type` as transformers sets it (from the labels when unset)."""
    reference, model = classifiers
    mask = (LEFT_PADDED != PAD_ID).long()
    targets = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    for problem_type in ("multi_label_classification", "regression"):
        reference.config.problem_type = model.config.problem_type = problem_type
        with torch.no_grad():
            expected = reference(input_ids=LEFT_PADDED, attention_mask=mask, labels=targets).loss
            loss = model(input_ids=LEFT_PADDED, attention_mask=mask, labels=targets).loss
        assert abs(loss.item() - expected.item()) < 1e-4, problem_type
    reference.config.problem_type = model.config.problem_type = None


def test_hidden_states_equal_automodel(dirs):
    """`AutoDistributedModel` over the causal checkpoint gives `AutoModel`'s `last_hidden_state` (after
    the final norm) at every real token, from ids or from embeddings."""
    causal_dir, _cls_dir = dirs
    reference = AutoModel.from_pretrained(causal_dir).eval()
    model = AutoDistributedModel.from_local_parts(causal_dir, local_backend(causal_dir))
    mask = (RIGHT_PADDED != PAD_ID).long()
    with torch.no_grad():
        expected = reference(input_ids=RIGHT_PADDED, attention_mask=mask).last_hidden_state
        hidden = model(input_ids=RIGHT_PADDED, attention_mask=mask).last_hidden_state
        embeds = model.get_input_embeddings()(RIGHT_PADDED)
        from_embeds = model(inputs_embeds=embeds, attention_mask=mask).last_hidden_state
    real = mask.bool()  # what a model computes at padding positions is nobody's business
    assert hidden.shape == expected.shape
    assert torch.allclose(hidden[real], expected[real], atol=1e-4)
    assert torch.allclose(from_embeds, hidden, atol=1e-6)
    # with a trained prompt, the output keeps the input's positions and the gradient reaches the prompt
    tuned = AutoDistributedModel.from_local_parts(
        causal_dir, local_backend(causal_dir), tuning_mode="ptune", pre_seq_len=2
    )
    output = tuned(input_ids=RIGHT_PADDED, attention_mask=mask).last_hidden_state
    assert output.shape == expected.shape
    output[real].sum().backward()
    assert tuned.prompts.prompt_embeddings.weight.grad.abs().sum() > 0


def test_inputs_embeds_are_read_at_the_last_position(classifiers):
    """As in transformers: embeddings carry no pad token ids, so every sequence is read at its end."""
    reference, model = classifiers
    mask = (LEFT_PADDED != PAD_ID).long()
    embeds = model.get_input_embeddings()(LEFT_PADDED)
    with torch.no_grad():
        expected = reference(inputs_embeds=embeds, attention_mask=mask).logits
        logits = model(inputs_embeds=embeds, attention_mask=mask).logits
    assert torch.allclose(logits, expected, atol=1e-4)


def test_training_head_and_deep_prompts_lowers_the_loss(dirs):
    """A causal checkpoint has no head: the client starts one (transformers' init) and trains it with
    deep prompts; the gradient reaches every prompt through the blocks, the client parts stay frozen."""
    causal_dir, _cls_dir = dirs
    torch.manual_seed(0)
    model = local_classifier(causal_dir, tuning_mode="deep_ptune", pre_seq_len=2, num_labels=NUM_LABELS)
    assert not any(parameter.requires_grad for parameter in model.client_parts.parameters())
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    assert len(trainable) == 3  # the head, the input prompt, the per-block prompts
    optimizer = torch.optim.Adam(trainable, lr=0.05)
    losses = []
    for _ in range(4):
        loss = model(input_ids=TRAIN_IDS, labels=TRAIN_LABELS).loss
        optimizer.zero_grad()
        loss.backward()
        assert all(parameter.grad.abs().sum() > 0 for parameter in trainable)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


def test_bad_input_is_refused_clearly(dirs):
    causal_dir, cls_dir = dirs
    with pytest.raises(SwarmUserError, match="has 3 labels, but num_labels is 5"):
        local_classifier(cls_dir, num_labels=5)
    fresh = local_classifier(cls_dir, num_labels=5, ignore_mismatched_sizes=True)
    assert fresh.score.weight.shape[0] == 5 and fresh.num_labels == 5
    with pytest.raises(TypeError, match="not an attribute of the model's config"):
        local_classifier(cls_dir, label_count=5)
    unpadded = local_classifier(cls_dir, pad_token_id=None)
    assert unpadded(input_ids=ONE).logits.shape == (1, NUM_LABELS)  # one sequence needs no pad token
    with pytest.raises(ValueError, match="Cannot handle batch sizes > 1 if no padding token"):
        unpadded(input_ids=LEFT_PADDED)
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        unpadded()
    with pytest.raises(ValueError, match="does not support position_ids"):
        unpadded(input_ids=ONE, position_ids=torch.arange(6)[None])
    with pytest.raises(ValueError, match="does not support output_hidden_states"):
        AutoDistributedModel.from_local_parts(causal_dir, local_backend(causal_dir))(
            input_ids=ONE, output_hidden_states=True
        )


@pytest.mark.swarm
def test_real_servers_classify_and_train_like_local_blocks(swarm, llama_dir, tmp_path):
    """Server "a" holds blocks of the causal checkpoint, "b" of the classification checkpoint, under
    one DHT prefix (the head is the client's: servers only need the blocks). Logits equal
    transformers'; with deep prompts, the loss and the gradients of head and prompts (the servers'
    backward RPC) equal local blocks', and Adam steps lower the loss."""
    cls_dir = save_classifier(llama_dir, tmp_path / "llama-cls")
    prefix = default_prefix(str(llama_dir))
    swarm.start_server("a", llama_dir, "0:3")
    swarm.start_server("b", cls_dir, f"3:{NUM_BLOCKS}", "1GB", "--dht-prefix", prefix)
    swarm.wait_online(prefix, NUM_BLOCKS, ["a", "b"])
    remote = AutoDistributedModelForSequenceClassification.from_pretrained(
        cls_dir, swarm.initial_peers, dht_prefix=prefix, tuning_mode="deep_ptune", pre_seq_len=2
    )
    try:
        mask = (LEFT_PADDED != PAD_ID).long()
        plain = DistributedModelForSequenceClassification.from_local_parts(cls_dir, remote.backend)
        reference = AutoModelForSequenceClassification.from_pretrained(cls_dir).eval()
        with torch.no_grad():
            expected = reference(input_ids=LEFT_PADDED, attention_mask=mask).logits
            logits = plain(input_ids=LEFT_PADDED, attention_mask=mask).logits
        assert torch.allclose(logits, expected, atol=1e-4)

        local = local_classifier(cls_dir, tuning_mode="deep_ptune", pre_seq_len=2)
        torch.nn.init.normal_(remote.prompts.intermediate_prompt_embeddings.weight, std=0.1)
        local.load_state_dict(remote.state_dict())
        for model in (remote, local):
            model(input_ids=LEFT_PADDED, attention_mask=mask, labels=torch.tensor([2, 0])).loss.backward()
        for name, parameter in remote.named_parameters():
            if parameter.requires_grad:
                assert torch.allclose(parameter.grad, local.get_parameter(name).grad, atol=1e-4), name

        optimizer = torch.optim.Adam([p for p in remote.parameters() if p.requires_grad], lr=0.05)
        losses = []
        for _ in range(3):
            loss = remote(input_ids=TRAIN_IDS, labels=TRAIN_LABELS).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0], losses
    finally:
        remote.shutdown()
