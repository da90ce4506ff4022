"""Sequence parallelism inside tensor parallelism (`parallel.sequence_parallel`): the sequence-axis arithmetic of
the collectives' fallbacks and native forms in one process, the rule book's refusals and warning, the placement of
the norms' gradients, the planner's activations, and on two msrun workers (jobs of the shared launch) tp2 with it
training as one process does, on packed rows whose documents reset attention."""

from __future__ import annotations


import mindspore as ms
import numpy as np
import pytest
from conftest import TWO_WORKER_JOBS

from model_core.parallel import comm
from model_core.parallel.layout import Layout
from model_core.parallel.placement import placement_table
from params import ParamsError, load_params
from params.rules import check_run

SP = ("parallel.tensor_parallel=2", "parallel.sequence_parallel=true", "parallel.micro_batches=4")
DOCUMENTS = "train.reset_at_document_boundaries=true"  # packed rows of several documents, attention reset at each


def _array(*shape: int, offset: float = 0.0) -> np.ndarray:
    return np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + offset


def test_the_sequence_fallbacks_add_up_to_the_gather_and_keep_the_own_block():
    slices = [_array(2, 3, 4, offset=100 * r) for r in range(3)]
    contributions = [comm.sequence_gather_contribution(ms.Tensor(x), r, 3).asnumpy() for r, x in enumerate(slices)]
    np.testing.assert_array_equal(sum(contributions), np.concatenate(slices, axis=1))
    whole = _array(2, 6, 4)
    for r in range(3):
        np.testing.assert_array_equal(comm.own_sequence_block(ms.Tensor(whole), r, 3).asnumpy(), whole[:, 2 * r : 2 * r + 2])


def test_the_native_forms_move_sequence_blocks_to_axis_0_and_back():
    """An axis-0 reduce-scatter of the stacked blocks is the sequence reduce-scatter; an axis-0 all-gather laid out
    along the sequence is the sequence all-gather."""
    wholes = [_array(2, 6, 4, offset=10 * r) for r in range(2)]
    stacked = sum(comm.sequence_blocks_stacked(ms.Tensor(x), 2).asnumpy() for x in wholes)  # the reduce of an axis-0 scatter
    for r in range(2):
        np.testing.assert_array_equal(stacked[2 * r : 2 * r + 2], np.split(sum(wholes), 2, axis=1)[r])
    slices = [_array(2, 3, 4, offset=10 * r) for r in range(2)]
    gathered = comm.blocks_along_sequence(ms.Tensor(np.concatenate(slices)), 2).asnumpy()
    np.testing.assert_array_equal(gathered, np.concatenate(slices, axis=1))


def test_a_sequence_tp_does_not_divide_is_refused_with_both_numbers():
    with pytest.raises(ParamsError, match="parallel.tensor_parallel=2 does not divide model.seq_len=129"):
        load_params("tiny", ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true", "model.seq_len=129"])


def test_sequence_parallelism_with_experts_is_refused():
    with pytest.raises(ParamsError, match=r"parallel.sequence_parallel=true with model.moe \(4 MoE blocks\)"):
        load_params("tiny", ["model.moe.num_experts=4", *SP])


def test_sequence_parallelism_without_tensor_parallelism_runs_with_a_warning():
    """One params file runs under several layouts (plan --try, a resume on another tp): at tp=1 there is nothing
    to split, which is said, not refused."""
    params = load_params("tiny", ["parallel.sequence_parallel=true"])
    (warning,) = check_run(params)
    assert warning.startswith("parallel.sequence_parallel=true with parallel.tensor_parallel=1")
    assert check_run(load_params("tiny", list(SP))) == []


def test_under_sequence_parallelism_the_norms_gradients_are_shares_summed_over_tp():
    model = load_params("tiny").model
    plain, split = placement_table(model, Layout(tp=2)), placement_table(model, Layout(tp=2), sequence_parallel=True)
    norms = {row.name for row in plain if row.name.endswith("layernorm.weight") or row.name == "norm.weight"}
    assert len(norms) == 2 * model.num_layers + 1
    assert not any(row.tp_partial for row in plain)
    assert {row.name for row in split if row.tp_partial} == norms
    assert [(r.name, r.shape, r.tp_axis) for r in split] == [(r.name, r.shape, r.tp_axis) for r in plain]
    assert not placement_table(model, Layout(), sequence_parallel=True).sequence_parallel  # tp1: nothing to split


TWO_WORKER_JOBS["tp2-sp-documents"] = (*SP, DOCUMENTS)


@pytest.fixture(scope="module")
def documents_single_process(dataset_dir, tmp_path_factory) -> list[dict]:
    from test_parallel_msrun import one_process

    return one_process(dataset_dir, tmp_path_factory.mktemp("documents"), DOCUMENTS)


@pytest.mark.slow
def test_tp2_with_sequence_parallelism_trains_as_one_process_on_rows_of_several_documents(
    two_worker_jobs, documents_single_process
):
    """The embedding's reduce-scatter, the norms on slices, the gathers before q/k/v, gate/up and the head, the
    reduce-scatters after o_proj and down_proj, and the norms' gradients summed over tp: 20 steps' loss and
    gradient norm within 1e-5 of one process, with RoPE positions and document masks of the whole sequence."""
    from test_parallel_msrun import assert_same_metrics

    _, ranks = two_worker_jobs["tp2-sp-documents"]
    for rank in ranks:
        assert_same_metrics(rank["history"], documents_single_process)


@pytest.mark.slow
@pytest.mark.extended  # four workers each; tp2 with sequence parallelism runs by default
@pytest.mark.parametrize("layout, documents", [
    pytest.param(("parallel.pipeline_parallel=2",), True, id="tp2-pp2"),
    pytest.param(("parallel.pipeline_parallel=2",), False, id="tp2-pp2-rows-without-positions"),
    pytest.param(("parallel.data_parallel=2", "parallel.zero_stage=3", "parallel.micro_batches=2"), True, id="dp2-tp2-zero3"),
])
def test_sequence_parallelism_composes_with_pipeline_stages_and_zero3(layout, documents, dataset_dir, request, tmp_path):
    """A later stage receives its slice of the sequence and builds RoPE and masks for the whole (from the rows'
    positions, or without them from the positions its pipeline stage gives it); ZeRO-3 gathers each weight inside
    the projections that gather the sequence."""
    from test_parallel_msrun import assert_same_metrics, train_job

    ranks = train_job(tmp_path, dataset_dir, *SP, *([DOCUMENTS] if documents else []), *layout, workers=4)
    expected = request.getfixturevalue("documents_single_process" if documents else "single_process")
    for rank in ranks:
        assert_same_metrics(rank["history"], expected if documents else expected["history"])


def test_the_planner_counts_the_residual_streams_slices_and_the_gathered_slice():
    """Per layer, the norms' fp32 inputs and the projections' normed inputs (2 BTH (4 + c)) drop to 1/tp; the last
    stage's head inputs too; tp's communication buffers gain one slice."""
    from model_core.parallel.planner import CPU, Candidate, activation_bytes, backward_communication_bytes

    overrides = ["model.seq_len=512", "train.micro_batch_size=2", "parallel.tensor_parallel=2"]
    plain, split = load_params("tiny", overrides), load_params("tiny", [*overrides, "parallel.sequence_parallel=true"])
    candidate = Candidate(1, 2, 1, 0, "none")
    tokens, hidden, layers = 2 * 512, plain.model.hidden_size, plain.model.num_layers
    between = tokens * hidden * (4 + 4)  # fp32 compute: a norm's input and its projections' input, per norm
    saved = (layers * 2 * between + between) // 2  # two norms a layer, the final norm and the head; half kept
    difference = activation_bytes(plain, candidate, 0, CPU) - activation_bytes(split, candidate, 0, CPU)
    assert difference == pytest.approx(CPU.activation_factor * saved, abs=1)  # each side rounded down once
    added = backward_communication_bytes(split, candidate, 0) - backward_communication_bytes(plain, candidate, 0)
    assert added == tokens * hidden * 4 // 2
    one = Candidate(2, 1, 1, 0, "none")  # tp1: nothing to split
    assert activation_bytes(plain, one, 0, CPU) == activation_bytes(split, one, 0, CPU)


def test_on_cpu_the_planner_charges_a_rank_what_its_collectives_add_to_the_step():
    """A rank of a job of several ranks, and each layer's collectives: tp's, sequence parallelism's on top, cp's."""
    from model_core.parallel.planner import ACCELERATOR, CPU, Candidate, collective_graph_bytes

    plain, split = load_params("tiny"), load_params("tiny", list(SP))
    layers = plain.model.num_layers
    assert collective_graph_bytes(plain, Candidate(1, 1, 1, 0, "none"), CPU, layers) == 0  # one process
    assert collective_graph_bytes(plain, Candidate(2, 1, 1, 0, "none"), CPU, layers) == CPU.collective_runtime_bytes
    tp = collective_graph_bytes(plain, Candidate(1, 2, 1, 0, "none"), CPU, layers)
    assert tp == CPU.collective_runtime_bytes + layers * CPU.tensor_parallel_bytes_per_layer
    sp = collective_graph_bytes(split, Candidate(1, 2, 1, 0, "none"), CPU, layers)
    assert sp - tp == layers * CPU.sequence_parallel_bytes_per_layer > 0
    cp = collective_graph_bytes(plain, Candidate(1, 1, 1, 0, "none", cp=2), CPU, layers)
    assert cp == CPU.collective_runtime_bytes + layers * CPU.context_parallel_bytes_per_layer
    assert collective_graph_bytes(split, Candidate(1, 2, 1, 0, "none", cp=2), ACCELERATOR, layers) == 0
