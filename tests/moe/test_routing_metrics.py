"""Routing metrics (moe/metrics.py): the routers' records and the report against hand-computed values on a tiny
GPT, eager against compiled, one process against EP = 2, and what MetricsWriter writes of them.

The tiny GPT routes by the expert bias alone: zero router weights make every logit 0, so every sigmoid score
is 0.5 and each token picks the two experts of highest bias. Its first MoE layer sends every token to experts
0 and 1, its second to experts 2 and 3. The losses follow by hand: each token's normalised scores are 1/4, so
the Switch loss is ``E * sum_e f_e / 4 = 1`` whatever the top-k, and the z-loss is ``logsumexp(0, 0, 0, 0)^2
= log(4)^2``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from moe_core.config import TransformerConfig
from moe_core.models.gpt import GPTModel
from moe_core.moe.metrics import RoutingRecorder, routing_report
from moe_core.training.metrics import MetricsWriter
from tests.parallel._common import groups
from tests.parallel._launch import device, run_distributed

E, BATCH, SEQ = 4, 4, 8
TOKENS = BATCH * SEQ
BIASES = ([1.0, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.5])


def tiny_config(ep: int = 1) -> TransformerConfig:
    return TransformerConfig(
        num_layers=3, first_k_dense_replace=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=16,
        vocab_size=32, seq_length=SEQ, num_moe_experts=E, moe_router_topk=2, moe_ffn_hidden_size=8,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3,
        expert_model_parallel_size=ep,
    )


def tiny_model(ep: int = 1, pg=None) -> GPTModel:
    torch.manual_seed(0)
    model = GPTModel(tiny_config(ep), pg).to(device())
    with torch.no_grad():
        for layer, bias in zip(model.moe_layers(), BIASES, strict=True):
            layer.router.weight.zero_()
            layer.router.expert_bias.copy_(torch.tensor(bias))
    return model


def train_forward(model: GPTModel, rows: slice = slice(None)) -> None:
    ids = torch.randint(0, 32, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))[rows].to(device())
    model(ids, ids).sum().backward()


def metrics_of(model: GPTModel, pg=None) -> dict:
    return routing_report(model.moe_layers(), pg, layer_numbers=[1, 2]).metrics()


EXPECTED_LAYERS = {
    "layer_1": {"load_min": 0.0, "load_max": TOKENS, "load_cv": 1.0, "dead_experts": 2, "aux_loss": 1.0,
                "z_loss": math.log(4) ** 2, "tokens_per_expert": [TOKENS, TOKENS, 0.0, 0.0]},
    "layer_2": {"load_min": 0.0, "load_max": TOKENS, "load_cv": 1.0, "dead_experts": 2, "aux_loss": 1.0,
                "z_loss": math.log(4) ** 2, "tokens_per_expert": [0.0, 0.0, TOKENS, TOKENS]},
}


def check_hand_computed(metrics: dict) -> None:
    layers = metrics.pop("moe")
    assert list(layers) == list(EXPECTED_LAYERS)
    for name, expected in EXPECTED_LAYERS.items():
        assert layers[name] == pytest.approx(expected, rel=1e-6), name
    assert metrics == pytest.approx({"aux_loss": 2.0, "z_loss": 2 * math.log(4) ** 2, "expert_load_min": 0.0,
                                     "expert_load_max": TOKENS, "expert_load_cv": 1.0, "dead_experts": 4},
                                    rel=1e-6)


def test_report_of_a_tiny_gpt_is_the_hand_computed_one():
    model = tiny_model()
    train_forward(model)
    check_hand_computed(metrics_of(model))


def test_only_training_forwards_with_grad_record():
    model = tiny_model()
    train_forward(model)
    recorded = [layer.router.recorder.tokens_per_expert.clone() for layer in model.moe_layers()]
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device=device())
    with torch.no_grad():
        for layer in model.moe_layers():
            layer.router.expert_bias.copy_(layer.router.expert_bias.flip(0))  # a forward that recorded would show it
    model.eval()
    model(ids, ids)
    model.train()
    with torch.no_grad():
        model(ids, ids)
    for layer, loads in zip(model.moe_layers(), recorded, strict=True):
        assert torch.equal(layer.router.recorder.tokens_per_expert, loads)


def test_compiled_layers_report_what_eager_layers_do():
    torch._dynamo.reset()  # the layers' code is compiled afresh, not against earlier tests' cached frames
    eager, compiled = tiny_model(), tiny_model()
    for layer in compiled.decoder.layers:
        layer.compile(backend="aot_eager", fullgraph=True)
    for model in (eager, compiled):
        train_forward(model)
        train_forward(model)  # the second call replays the compiled graph
    assert metrics_of(compiled) == metrics_of(eager)
    check_hand_computed(metrics_of(compiled))


def test_recorder_keeps_its_dtypes_and_names():
    recorder = RoutingRecorder(E, ["z_loss", "aux_loss"]).to(torch.bfloat16)
    assert recorder.loss_names == ("aux_loss", "z_loss")
    assert (recorder.tokens_per_expert.dtype, recorder.losses.dtype) == (torch.float32, torch.float64)
    with pytest.raises(ValueError, match=r"loss_names: expected names from .*got \['sinkhorn'\]"):
        RoutingRecorder(E, ["sinkhorn"])
    with pytest.raises(ValueError, match="layer_numbers: expected 2 numbers"):
        routing_report(tiny_model().moe_layers(), layer_numbers=[1])
    assert routing_report([]) is None


def _ep2_metrics() -> dict:
    import torch.distributed as dist

    pg = groups(2, E)
    model = tiny_model(ep=2, pg=pg)
    half = BATCH // 2
    train_forward(model, slice(dist.get_rank() * half, (dist.get_rank() + 1) * half))
    return metrics_of(model, pg)


def test_ep2_report_equals_the_single_process_one():
    """Each EP rank routes half the batch; the report sums the loads over the ranks and averages the losses:
    every rank gets the single-process report, and the busiest EP rank gets all rows of each layer."""
    ranks = run_distributed(2, _ep2_metrics, timeout=120)
    assert ranks[0] == ranks[1]
    metrics = dict(ranks[0])
    assert metrics.pop("ep_load_imbalance") == 2.0
    check_hand_computed(metrics)


def test_writer_puts_the_report_in_jsonl_and_tensorboard(tmp_path):
    model = tiny_model()
    train_forward(model)
    writer = MetricsWriter(str(tmp_path))
    writer.log(5, {"loss": 1.0, **metrics_of(model)})
    writer.close("tiny")
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["dead_experts"] == 4 and row["moe"]["layer_2"]["tokens_per_expert"] == [0.0, 0.0, TOKENS, TOKENS]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars, histograms = events.Tags()["scalars"], events.Tags()["histograms"]
    assert {"dead_experts", "expert_load_cv", "aux_loss", "moe/layer_1/dead_experts", "moe/layer_2/z_loss",
            "moe/layer_1/load_cv"} <= set(scalars)
    assert set(histograms) == {"moe/layer_1/tokens_per_expert", "moe/layer_2/tokens_per_expert"}
    histogram = events.Histograms("moe/layer_1/tokens_per_expert")[0]
    assert histogram.step == 5 and histogram.histogram_value.num == E and histogram.histogram_value.max == TOKENS
