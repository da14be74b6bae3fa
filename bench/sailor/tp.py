"""hplan's tensor-parallel model applied to the study's plans: one GPU's times and the link.

The study profiled every layer at each TP degree inside a real Megatron-DeepSpeed TP run
(CUDA events around each module's forward and backward, ``sailor/profiling/
profile_utils.py`` of its repository), so its ``tp`` times hold the layer's collectives
already; ``plan.study_sim_spec`` simulates with them. hplan's own planner has one GPU's
profile only and must model a TP group: every layer's compute divided by the degree ``d``
(Megatron splits OPT's embedding, blocks and head), plus the layer's all-reduces of the
float32 activation ``(mbs, 2048, 1024)`` over the node's link as ring all-reduces
(``link_model.tp_layer_all_reduce_time_s``). :func:`tp_model_sim_spec` simulates a study
plan that way, from the study's tp 1 profile and its measured intra-node bandwidth curve
(``network/intra_node.json``: GH200's NVLink, the consumer GPUs' PCIe), so that the model
can be checked against the measured iteration times and, layer by layer, against the
study's own ``tp`` profiles (:func:`tp_layer_times_s`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hplan.planner.sim.ir import SimReplica, SimSpec, SimStage
from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.link_model import (
    tp_all_reduce_time_s,
    tp_layer_all_reduce_time_s,
)
from hplan.runtime.contract.plan import DTYPE_BYTES

from .data import TRAINING_DTYPE, SailorData, curves_alpha_beta, intra_node_curve
from .study import StudyPlan, StudyStage

LOSS_ALL_REDUCES = 3
"""All-reduces of one float per token in Megatron's vocab-parallel cross entropy (the
logits' maximum, the target's logit, the sum of exponentials: ``_VocabParallelCrossEntropy``,
Shoeybi et al., 2019, section 3)."""


@dataclass(frozen=True, slots=True)
class TpChannel:
    """A TP group's ring channel: alpha-beta of the study's intra-node curve."""

    degree: int
    bandwidth_bytes_per_s: float
    latency_s: float


def tp_channel(data: SailorData, gpu: str, degree: int, mbs: int) -> TpChannel:
    """The ring channel of ``degree`` GPUs of one ``gpu`` machine for micro-batches of
    ``mbs``: the study's intra-node curve fitted (``data.curves_alpha_beta``) over the
    messages a ring step moves, ``1/d`` of an all-reduced buffer (the study's own ring
    estimate, see its README), from the loss's per-token floats to the activation.

    Raises:
        ConfigError: the study has no curve for ``degree`` GPUs of that type.
    """
    curve = intra_node_curve(data, gpu, degree)
    smallest = mbs * data.seq_len * DTYPE_BYTES[TRAINING_DTYPE] / degree
    bandwidth, latency = curves_alpha_beta([curve], smallest, activation_bytes(data, mbs) / degree)
    return TpChannel(degree, bandwidth, latency)


def activation_bytes(data: SailorData, mbs: int) -> float:
    """The float32 hidden state of one micro-batch: ``mbs x seq x hidden x 4``."""
    return float(mbs * data.seq_len * data.hidden * DTYPE_BYTES[TRAINING_DTYPE])


def layer_collectives_s(
    data: SailorData, layer: int, mbs: int, channel: TpChannel
) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's TP collectives (Megatron's OPT, Shoeybi et
    al., 2019, section 3): a block, two all-reduces of the activation per pass
    (``link_model.tp_layer_all_reduce_time_s``); the embedding, one in the forward (the
    vocab-split lookups summed); the head, one in the backward (its input's gradient) and
    :data:`LOSS_ALL_REDUCES` of one float per token in the forward."""
    d, bw, lat = channel.degree, channel.bandwidth_bytes_per_s, channel.latency_s
    act = activation_bytes(data, mbs)
    if layer == 0:
        return tp_all_reduce_time_s(d, act, bw, lat), 0.0
    if layer == data.num_layers - 1:
        loss_bytes = LOSS_ALL_REDUCES * mbs * data.seq_len * DTYPE_BYTES[TRAINING_DTYPE]
        return tp_all_reduce_time_s(d, loss_bytes, bw, lat, LOSS_ALL_REDUCES), (
            tp_all_reduce_time_s(d, act, bw, lat)
        )
    block_s = tp_layer_all_reduce_time_s(d, act, bw, lat)
    return block_s, block_s


def tp_layer_times_s(
    data: SailorData, gpu: str, mbs: int, layer: int, channel: TpChannel
) -> tuple[float, float, float, float]:
    """(forward compute, backward compute, forward collectives, backward collectives) of
    ``layer`` on a TP group: the study's tp 1 times divided by the degree, and
    :func:`layer_collectives_s`.

    Raises:
        ConfigError: the study did not profile ``gpu`` at tp 1.
    """
    times = data.fitted_layer_times(gpu, mbs, 1)
    if times is None:
        raise ConfigError(f"the study has no tp 1 profile of {gpu}; choose a measured GPU")
    fwd_s, bwd_s, _ = times[str(layer)]
    tp_fwd_s, tp_bwd_s = layer_collectives_s(data, layer, mbs, channel)
    return fwd_s / channel.degree, bwd_s / channel.degree, tp_fwd_s, tp_bwd_s


def tp_model_sim_spec(data: SailorData, study: StudyPlan, spec: SimSpec) -> SimSpec:
    """``spec`` (``plan.study_sim_spec`` of the study plan) with every TP stage's times
    from hplan's TP model instead of the study's ``tp`` profile: compute and optimizer
    step of tp 1 divided by the degree, the layers' collectives as their own spans.

    Raises:
        ConfigError: a GPU without a tp 1 profile or an intra-node curve at its degree.
    """
    replicas = tuple(
        _replica(data, study, stages, sim)
        for stages, sim in zip(study.replicas, spec.replicas, strict=True)
    )
    return replace(spec, replicas=replicas)


def _replica(
    data: SailorData, study: StudyPlan, stages: tuple[StudyStage, ...], sim: SimReplica
) -> SimReplica:
    return replace(
        sim,
        stages=tuple(_stage(data, study, a, b) for a, b in zip(stages, sim.stages, strict=True)),
    )


def _stage(data: SailorData, study: StudyPlan, stage: StudyStage, sim: SimStage) -> SimStage:
    degree = stage.machine.tp
    if degree == 1:
        return sim
    channel = tp_channel(data, stage.machine.gpu, degree, study.mbs)
    rows = [tp_layer_times_s(data, stage.machine.gpu, study.mbs, x, channel) for x in stage.layers]
    fwd, bwd, tp_fwd, tp_bwd = (sum(r[i] for r in rows) for i in range(4))
    times = data.fitted_layer_times(stage.machine.gpu, study.mbs, 1)
    assert times is not None  # checked by tp_layer_times_s
    optimizer_s = sum(times[str(x)][2] for x in stage.layers) / degree
    num_mb = len(sim.forward_s)
    return replace(
        sim,
        forward_s=(fwd,) * num_mb,
        backward_s=(bwd,) * num_mb,
        optimizer_s=optimizer_s,
        tp_degree=degree,
        tp_forward_s=(tp_fwd,) * num_mb,
        tp_backward_s=(tp_bwd,) * num_mb,
    )


@dataclass(frozen=True, slots=True)
class LayerCheck:
    """One transformer layer at one (GPU, mbs, tp): the study's measured time against the
    TP model's, forward and backward together, per micro-batch."""

    gpu: str
    mbs: int
    degree: int
    measured_s: float
    modelled_s: float
    collectives_s: float
    """Of ``modelled_s``: the TP collectives."""

    @property
    def error(self) -> float:
        return (self.modelled_s - self.measured_s) / self.measured_s


def layer_checks(data: SailorData, layer: int = 1) -> list[LayerCheck]:
    """Every (GPU, mbs, tp > 1) the study profiled that the TP model can price (a tp 1
    profile at that mbs and an intra-node curve at that degree): ``layer`` measured at
    ``tp`` against :func:`tp_layer_times_s`. Sorted by GPU, degree, mbs."""
    out = []
    for gpu, by_mbs in sorted(data.profiles.items()):
        for mbs_key, per_tp in by_mbs.items():
            mbs = int(mbs_key)
            if "1" not in per_tp:
                continue
            for tp_key, layers in per_tp.items():
                degree = int(tp_key)
                if degree == 1 or str(degree) not in data.intra_node.get(gpu, {}):
                    continue
                channel = tp_channel(data, gpu, degree, mbs)
                fwd, bwd, tp_fwd, tp_bwd = tp_layer_times_s(data, gpu, mbs, layer, channel)
                measured = layers[str(layer)][0] + layers[str(layer)][1]
                out.append(
                    LayerCheck(
                        gpu, mbs, degree, measured, fwd + bwd + tp_fwd + tp_bwd, tp_fwd + tp_bwd
                    )
                )
    return sorted(out, key=lambda c: (c.gpu, c.degree, c.mbs))
