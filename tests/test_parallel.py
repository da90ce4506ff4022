"""Fast checks of the parallel layout, the all-reduce fallbacks' arithmetic, gradient buckets, ZeRO-1 shards,
ZeRO-3's per-parameter shards (and its cells with a group of one rank) and the launcher's refusals, all in one
process (no msrun)."""

from __future__ import annotations

import socket

import mindspore as ms
import numpy as np
import pytest
from conftest import SMALL_MODEL
from mindspore import Parameter, Tensor

from model_core.data import PackedRows
from model_core.model import Llama
from model_core.model.weights import model_weights, named_weights
from model_core.optim.step import AccumulateGradients
from model_core.parallel import comm
from model_core.parallel import launch as launcher
from model_core.parallel.data_parallel import bucket_indices
from model_core.parallel.launch import launch, launch_training, log_tail
from model_core.parallel.layout import Layout, ParallelConfigError
from model_core.parallel.optimizer import AdamW, RankState
from model_core.parallel.placement import PARAMETER_SHARD, StatePlacement
from model_core.parallel.zero import (
    FlatShards,
    GradientShards,
    ShardGather,
    block_pieces,
    bucket_inputs,
    early_buckets,
    flat_shards,
    gather_plan,
    merged_order,
)
from model_core.parallel.zero3 import join_shards, shard_parameters, take_shard
from model_core.train.loader import ShuffledBatches
from params import ParamsError, load_params
from params.rules import check_tensor_parallel


def params_with(*overrides: str):
    return load_params("tiny", list(overrides))


def test_ranks_put_tensor_parallel_innermost_and_pipeline_outermost():
    layout = Layout(dp=2, tp=2, pp=2)
    assert [tuple(vars(layout.coordinates(r)).values()) for r in range(8)] == [
        (0, 0, 0, 0), (0, 1, 0, 0), (1, 0, 0, 0), (1, 1, 0, 0), (0, 0, 1, 0), (0, 1, 1, 0), (1, 0, 1, 0), (1, 1, 1, 0),
    ]  # (dp, tp, pp, cp)
    assert all(layout.rank(**vars(layout.coordinates(r))) == r for r in range(8))
    assert layout.all_groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert layout.all_groups("dp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert layout.all_groups("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert layout.dp_group(5) == (5, 7) and layout.pp_group(6) == (2, 6)


def test_global_batch_counts_every_factor():
    assert Layout(dp=4).global_batch_rows(micro_batch_size=2, micro_batches=3, accumulation=5) == 120
    params = params_with("parallel.data_parallel=2", "parallel.micro_batches=3", "train.micro_batch_size=4")
    assert Layout.from_params(params).global_batch_rows(4, 3, 1) == params.global_batch_size == 24


def test_layout_errors_name_both_numbers():
    with pytest.raises(ParallelConfigError, match=r"data_parallel=2 x tensor_parallel=1 x pipeline_parallel=1 = 2 ranks, but the world has 4"):
        Layout.from_params(params_with("parallel.data_parallel=2"), world_size=4)
    with pytest.raises(ParallelConfigError, match=r"pipeline_parallel=3 does not divide model.num_layers=4"):
        Layout(pp=3).stage_sizes(4)
    with pytest.raises(ParallelConfigError, match="rank 4 is outside a world of 4"):
        Layout(dp=4).coordinates(4)


@pytest.mark.parametrize(
    ("model", "field", "value"),
    [
        (["model.num_heads=6", "model.num_kv_heads=3", "model.hidden_size=96"], "num_kv_heads", 3),
        (["model.num_heads=3", "model.num_kv_heads=1", "model.hidden_size=96"], "num_heads", 3),
        (["model.ffn_hidden_size=351"], "ffn_hidden_size", 351),
        (["model.vocab_size=4097"], "vocab_size", 4097),
    ],
)
def test_tensor_parallel_must_divide_heads_kv_heads_ffn_and_vocab(tmp_path, model, field, value):
    message = rf"parallel.tensor_parallel=2 does not divide model.{field}={value}"
    with pytest.raises(ParallelConfigError, match=message):
        check_tensor_parallel(2, params_with(*model).model)
    with pytest.raises(ParamsError, match=message):  # loading the params refuses them (params/rules.py)
        launch_training(params_with(*model, "parallel.tensor_parallel=2"), ["--params", "tiny"], tmp_path / "logs")
    assert not (tmp_path / "logs").exists()


def test_invalid_layouts_fail_before_anything_is_launched(tmp_path):
    with pytest.raises(ParamsError, match=r"tensor_parallel=2 does not divide model.vocab_size=511 \(pad it"):
        launch_training(params_with("parallel.tensor_parallel=2", "model.vocab_size=511"), ["--params", "tiny"], tmp_path / "logs")
    with pytest.raises(ParamsError, match="pipeline_parallel=2 does not divide model.num_layers=3 into equal stages"):
        odd = params_with("parallel.pipeline_parallel=2", "parallel.micro_batches=2", "model.num_layers=3")
        launch_training(odd, ["--params", "tiny"], tmp_path / "logs")
    with pytest.raises(ParallelConfigError, match="does not split evenly over 2 nodes"):
        launch(["-c", "pass"], 3, tmp_path / "logs", nodes=2)
    with pytest.raises(ParallelConfigError, match="node timeout 0 s"):
        launch(["-c", "pass"], 2, tmp_path / "logs", node_timeout_s=0)
    with pytest.raises(ParallelConfigError, match="collective timeout 10 s is shorter than the node timeout 15 s"):
        launch(["-c", "pass"], 2, tmp_path / "logs", node_timeout_s=15, collective_timeout_s=10)
    assert not (tmp_path / "logs").exists()


def test_a_lost_node_is_named_with_its_host_and_a_rerun_sets_the_earlier_logs_aside(tmp_path):
    """Node 0 reads the lost rank from the scheduler's log and the machine from the note the lost node left in
    the shared log directory; a rerun in that directory renames the logs it would otherwise read stale."""
    launcher._note_this_node(tmp_path, 1, "127.0.0.1")
    (tmp_path / "scheduler.log").write_text("[ERROR] DISTRIBUTED ... The node: 3 is timed out. It may exit ...\n")
    (tmp_path / "worker_2.log").write_text("the first attempt\n")
    message = launcher._failed_process(tmp_path / "msrun-node0.log", launcher._Watch(), ranks_per_node=2)
    assert message.startswith(f"rank 3 on node 1 (host {socket.gethostname()}, 127.0.0.1) stopped answering")
    launcher._set_aside_earlier_logs(tmp_path, range(2, 4), scheduler=False)
    assert (tmp_path / "worker_2.previous.log").read_text() == "the first attempt\n"
    assert not (tmp_path / "worker_2.log").exists() and (tmp_path / "scheduler.log").exists()


def test_a_rank_stopped_by_msrun_on_another_node_points_at_node_0(tmp_path):
    """On node 1, a rank ended by SIGTERM is what msrun does when node 0's scheduler goes away: the message
    sends the reader to node 0's log; on node 0, or for another code, it does not."""
    (tmp_path / "msrun-node1.log").write_text("Worker process 4242 exit with exception. Error code: -15\n")
    watch = launcher._Watch()
    watch.processes[4242] = launcher._Process("rank 1", tmp_path / "worker_1.log", 0.0)
    message = launcher._failed_process(tmp_path / "msrun-node1.log", watch, 1, node_rank=1, master_addr="192.0.2.1")
    assert message.startswith("rank 1 exited with code -15 (SIGTERM: msrun stops this node's ranks when the job's")
    assert "scheduler on node 0, 192.0.2.1, goes away" in message and "msrun-node0.log" in message
    (tmp_path / "msrun-node1.log").write_text("Worker process 4242 exit with exception. Error code: 1\n")
    assert "SIGTERM" not in launcher._failed_process(tmp_path / "msrun-node1.log", watch, 1, node_rank=1)
    (tmp_path / "msrun-node1.log").write_text("Worker process 4242 exit with exception. Error code: -15\n")
    assert "SIGTERM" not in launcher._failed_process(tmp_path / "msrun-node1.log", watch, 1, node_rank=0)


def _simulate(contribution, finish, inputs):
    """Run a fallback on every simulated rank: contributions, their all-reduce sum, each rank's result."""
    total = sum(contribution(ms.Tensor(x), rank).asnumpy() for rank, x in enumerate(inputs))
    return [finish(ms.Tensor(total), rank) for rank in range(len(inputs))]


@pytest.mark.parametrize("size", [2, 3])
def test_all_gather_fallback_is_a_sum_of_zero_filled_buffers(size):
    inputs = [np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * r for r in range(size)]
    outputs = _simulate(lambda x, r: comm.gather_contribution(x, r, size), lambda total, r: total.asnumpy(), inputs)
    for got in outputs:
        np.testing.assert_array_equal(got, np.concatenate(inputs))


def test_reduce_scatter_fallback_keeps_each_ranks_block_of_the_sum():
    inputs = [np.arange(12, dtype=np.float32).reshape(6, 2) * (r + 1) for r in range(3)]
    outputs = _simulate(lambda x, r: x, lambda total, r: comm.own_block(total, r, 3).asnumpy(), inputs)
    for rank, got in enumerate(outputs):
        np.testing.assert_array_equal(got, np.split(sum(inputs), 3)[rank])


def test_broadcast_fallback_spreads_only_the_roots_value_even_when_others_hold_inf():
    inputs = [np.full(3, np.inf, np.float32), np.array([1, 2, 3], np.float32), np.full(3, np.nan, np.float32)]
    flags = [ms.Tensor(np.eye(3, dtype=np.int32)[r]) for r in range(3)]
    outputs = _simulate(
        lambda x, r: comm.broadcast_contribution(x, flags[r][1]), lambda total, r: total.asnumpy(), inputs
    )
    for got in outputs:
        np.testing.assert_array_equal(got, inputs[1])


def test_a_group_of_one_needs_no_communication():
    alone = comm.Group((0,), 0)
    x = ms.Tensor(np.ones((2, 2), np.float32))
    for result in (alone.all_reduce(x), alone.all_reduce(x, "mean"), alone.all_gather(x), alone.reduce_scatter(x), alone.broadcast(x, 0)):
        np.testing.assert_array_equal(result.asnumpy(), x.asnumpy())
    with pytest.raises(ValueError, match="including this rank 3"):
        comm.Group((0, 1), 3)


def test_buckets_fill_in_order_and_a_large_item_stands_alone():
    assert bucket_indices([4, 4, 4, 20, 4, 4], bucket_bytes=10) == [[0, 1], [2], [3], [4, 5]]
    assert bucket_indices([1] * 5, bucket_bytes=100) == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize("bucket_bytes", [4, 20, 36, 1000])
def test_zero_shards_cover_every_element_exactly_once_in_buckets_of_one_block_a_rank(bucket_bytes):
    """Rank r keeps block r of every bucket: pieces in flat order, every element in exactly one rank's shard, the
    padding (past the last element only) under one element a bucket and rank (blocks too small to align)."""
    sizes = [7, 3, 12, 1]
    offsets = np.cumsum([0, *sizes])
    for shards in (1, 2, 3, 5):
        layout = flat_shards(sizes, shards, bucket_bytes)
        assert layout.shards * layout.chunk * 4 <= max(bucket_bytes, 4 * shards)  # a bucket within bucket_bytes
        assert layout.buckets * layout.shards * layout.chunk - sum(sizes) < layout.buckets * layout.shards
        covered = {}
        for shard in range(shards):
            pieces = layout.pieces(sizes, shard)
            assert sum(p.end - p.start for p in pieces) <= layout.length
            flat = [offsets[p.index] + e for p in pieces for e in range(p.start, p.end)]
            assert flat == sorted(flat)
            for position, element in enumerate(flat):  # where it sits in the shard: block k of bucket k
                bucket, at = divmod(element, shards * layout.chunk)
                assert at // layout.chunk == shard and position == bucket * layout.chunk + at % layout.chunk
                covered[element] = shard
        assert sorted(covered) == list(range(sum(sizes)))
        flat = np.arange(sum(sizes), dtype=np.float32)
        gathered = np.stack([_shard_of(flat, layout, sizes, shard) for shard in range(shards)])
        np.testing.assert_array_equal(layout.unshard(gathered), np.arange(sum(sizes)))


def _shard_of(flat: np.ndarray, layout: FlatShards, sizes, shard: int) -> np.ndarray:
    """Rank `shard`'s shard of the flat values, zero-padded to the layout's length."""
    offsets = np.cumsum([0, *sizes])
    held = [flat[offsets[p.index] + p.start : offsets[p.index] + p.end] for p in layout.pieces(sizes, shard)]
    out = np.zeros(layout.length, flat.dtype)
    values = np.concatenate(held) if held else np.zeros(0, flat.dtype)
    out[: values.size] = values
    return out


def test_large_buckets_cut_blocks_of_whole_vector_lanes():
    sizes = [4096 * 1000 + 7, 3000, 8]
    for shards in (2, 3, 8):
        layout = flat_shards(sizes, shards, 2**20)
        assert layout.chunk % 64 == 0 and layout.shards * layout.chunk * 4 <= 2**20
        assert layout.buckets * layout.shards * layout.chunk - sum(sizes) < 64 * layout.buckets * layout.shards


def test_a_given_block_cuts_the_leading_weight_alike_whatever_follows_it():
    """Two pipeline end stages share one block size, so their tied table (first on both) falls into the same pieces."""
    table = 10
    for shards in (2, 3):
        chunk = max(flat_shards([table, 5], shards, 24).chunk, flat_shards([table, 17, 4], shards, 24).chunk)
        for shard in range(shards):
            cuts = [[(p.start, p.end) for p in flat_shards(sizes, shards, 24, chunk).pieces(sizes, shard) if p.index == 0]
                    for sizes in ([table, 5], [table, 17, 4])]
            assert cuts[0] == cuts[1]


@pytest.mark.parametrize(("shards", "bucket_bytes"), [(1, 16), (2, 40), (3, 36), (2, 400), (3, 4)])
def test_the_bucketed_gather_of_updated_shards_rebuilds_every_weight_once_its_last_bucket_is_in(shards, bucket_bytes):
    sizes = [7, 3, 12, 1]
    layout = flat_shards(sizes, shards, bucket_bytes)
    flat = np.arange(sum(sizes), dtype=np.float32)
    shards_held = [_shard_of(flat, layout, sizes, shard) for shard in range(shards)]
    gathered = [np.concatenate([held[lo:hi] for held in shards_held]) for lo, hi in layout.bucket_ranges()]
    offsets = np.cumsum([0, *sizes])
    written = []
    for k, done in enumerate(gather_plan(sizes, layout)):
        for index, segments in done:
            assert max(b for b, _, _ in segments) == k  # written as soon as its last bucket arrives
            value = np.concatenate([gathered[b][start:end] for b, start, end in segments])
            np.testing.assert_array_equal(value, flat[offsets[index] : offsets[index + 1]])
            written.append(index)
    assert sorted(written) == list(range(len(sizes)))


@pytest.mark.parametrize("bucket_bytes", [20, 44, 4000])
def test_the_bucketed_gather_writes_weights_that_cross_buckets_in_place_row_by_row(bucket_bytes):
    """A weight that spans buckets is written part by part as each bucket arrives (whole rows, and the elements of a
    row a bucket's edge cuts), never rebuilt whole; every weight, of any rank and dtype, ends equal to its flat run."""
    shapes, dtypes = [(3, 5), (7,), (2, 3, 4), (1, 2)], [ms.float16, ms.float32, ms.float32, ms.float16]
    sizes = [int(np.prod(shape)) for shape in shapes]
    weights = [Parameter(Tensor(np.zeros(shape), dtype), name=f"w{i}") for i, (shape, dtype) in enumerate(zip(shapes, dtypes))]
    layout = flat_shards(sizes, 1, bucket_bytes)
    pieces = layout.pieces(sizes, 0)
    flat = np.arange(1, sum(sizes) + 1, dtype=np.float32)
    offsets = np.cumsum([0, *sizes])
    values = tuple(Tensor(flat[offsets[p.index] + p.start : offsets[p.index] + p.end]) for p in pieces)
    gather = ShardGather(weights, [(p.index, p.start, p.end) for p in pieces], layout, comm.Group((0,), 0))
    if bucket_bytes < 4 * sum(sizes):
        assert any(where >= 0 for bucket in gather.writes for *_, where in bucket)  # some weight is written in parts
    ms.jit(gather.construct)(values)
    for weight, shape, lo, hi in zip(weights, shapes, offsets[:-1], offsets[1:]):
        np.testing.assert_array_equal(weight.asnumpy().astype(np.float32), flat[lo:hi].reshape(shape))


@pytest.mark.parametrize(("shards", "bucket_bytes"), [(1, 16), (2, 40), (3, 36), (3, 48), (2, 400)])
def test_the_bucketed_reduce_scatter_gives_each_rank_the_sum_of_its_pieces(shards, bucket_bytes):
    """Each bucket is a contiguous run of the flat gradients (the last one padded), reduce-scattered last first:
    every rank's pieces end up holding the sum of its shard."""
    sizes = [7, 3, 12, 1]
    layout = flat_shards(sizes, shards, bucket_bytes)
    rng = np.random.default_rng(0)
    grads = [[rng.standard_normal(size) for size in sizes] for _ in range(shards)]  # each rank's, flattened
    whole = np.concatenate([np.concatenate(rank) for rank in grads]).reshape(shards, -1).sum(axis=0)
    inputs = bucket_inputs(sizes, layout)
    assert all(sum(end - start for _, start, end in parts) == shards * layout.chunk for parts in inputs)
    for rank in range(shards):
        pieces = layout.pieces(sizes, rank)
        lengths = [p.end - p.start for p in pieces]
        buffers = [np.zeros(n) for n in lengths]
        adds = block_pieces(layout.bucket_ranges(), lengths)
        for k in reversed(range(layout.buckets)):  # as `GradientShards` reduces them: the last bucket first
            flat = sum(np.concatenate([np.zeros(end) if i < 0 else mine[i][start:end] for i, start, end in inputs[k]])
                       for mine in grads)
            block = flat[rank * layout.chunk : (rank + 1) * layout.chunk]
            for j, start, end in adds[k]:
                buffers[j] += block[start:end]
        held = np.concatenate(buffers) if buffers else np.zeros(0)
        np.testing.assert_allclose(held, _shard_of(whole, layout, sizes, rank)[: held.size], rtol=0, atol=1e-12)


def test_two_stores_buckets_merge_into_one_chain_in_the_order_the_backward_finishes_them():
    """(store, position) of each bucket: each store's own order kept, the bucket whose first weight is latest taken
    first, a tie to the first store; computed from the readiness alone, so the same on every rank."""
    dense, experts = [9, 7, 7, 2, 0], [8, 7, 3]
    assert merged_order([dense, experts]) == ((0, 0), (1, 0), (0, 1), (0, 2), (1, 1), (1, 2), (0, 3), (0, 4))
    assert merged_order([[], [4, 1]]) == ((1, 0), (1, 1))
    # a store's own order stands even where its readiness rises (the native path completes pieces bucket k first)
    assert merged_order([[1, 5], [3]]) == ((1, 0), (0, 0), (0, 1))


def test_each_zero2_bucket_sums_through_a_collective_of_its_own_marked_fused():
    """MindSpore's kernel-by-kernel order runs what reads a plain collective's result only once nothing else is ready
    (inside a backward: at its end), and what reads one with a non-zero `fusion` attribute once the next such
    collective is issued (`comm.ReleasingReduceScatter`). Each bucket of a ZeRO-2 store gets its own collective with
    its own non-zero id, so none is merged with another; natively a ReduceScatter, else the all-reduce fallback.
    Built against a stand-in group: making the operators needs no job."""
    from types import SimpleNamespace

    weights = [Parameter(Tensor(np.zeros(shape, np.float32)), name=f"f{i}") for i, shape in enumerate([(4, 5), (3,), (6, 2)])]
    for native, operator in ((False, "AllReduce"), (True, "ReduceScatter")):
        group = SimpleNamespace(size=2, index=1, native_reduce_scatter=native, stand_ins=frozenset(),
                                backend_name="hccl_world_group")
        shards = GradientShards(weights, group, bucket_bytes=40)  # 5 elements a rank and bucket
        sums = list(shards.sums)
        assert len(sums) == shards.layout.buckets > 1
        assert {type(s.operator).__name__ for s in sums} == {operator}
        fusion = [s.operator.attrs["fusion"] for s in sums]
        assert all(f > 0 for f in fusion) and len(set(fusion)) == len(fusion)
    emulated = SimpleNamespace(size=2, index=1, native_reduce_scatter=True, stand_ins=frozenset({"reduce_scatter"}),
                               backend_name="hccl_world_group")
    assert type(comm.ReleasingReduceScatter(emulated).operator).__name__ == "AllReduce"  # the stand-in's fallback


def test_gradient_shards_over_a_group_of_one_add_every_gradient_through_small_buckets():
    weights = [Parameter(Tensor(np.zeros(shape, np.float32)), name=f"w{i}") for i, shape in enumerate([(4, 5), (3,), (6, 2)])]
    shards = GradientShards(weights, comm.Group((0,), 0), bucket_bytes=28)  # 7 elements a bucket

    class Step(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.shards = shards

        @ms.jit
        def construct(self, grads):
            return self.shards(grads)

    grads = [np.arange(w.size, dtype=np.float32).reshape(w.shape) + i for i, w in enumerate(weights)]
    step = Step()
    for _ in range(2):
        step(ms.mutable(tuple(Tensor(g) for g in grads)))
    held = np.concatenate([buffer.asnumpy() for buffer in shards.buffers])
    np.testing.assert_array_equal(held, 2 * np.concatenate([g.reshape(-1) for g in grads]))


def test_an_early_gradient_is_reduced_ahead_of_the_chain_in_the_buckets_that_hold_its_weight():
    """A tied table's head gradient (`early`), passed apart from the rest of the table's gradient, is reduced first,
    in the three buckets the table reaches (zeros for the next weight's elements in the last), and the rest after
    it: each piece of the table holds the sum of the two, the other weights their own."""
    weights = [Parameter(Tensor(np.zeros(shape, np.float32)), name=f"t{i}") for i, shape in enumerate([(4, 5), (3,), (6, 2)])]
    shards = GradientShards(weights, comm.Group((0,), 0), bucket_bytes=28, early=0)  # 7 elements a bucket
    assert early_buckets(shards.inputs, 0) == shards.early_buckets == (0, 1, 2)
    assert shards.early_inputs[2] == ((0, 14, 20), (-1, 0, 1))

    class Step(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.shards = shards

        @ms.jit
        def construct(self, grads, head):
            return self.shards(grads, head)

    grads = [np.arange(w.size, dtype=np.float32).reshape(w.shape) + i for i, w in enumerate(weights)]
    head = np.full((4, 5), 0.5, np.float32)
    Step()(ms.mutable(tuple(Tensor(g) for g in grads)), Tensor(head))
    held = np.concatenate([buffer.asnumpy() for buffer in shards.buffers])
    grads[0] = grads[0] + head
    np.testing.assert_array_equal(held, np.concatenate([g.reshape(-1) for g in grads]))


@pytest.mark.parametrize(("shards", "length"), [(1, 12), (2, 6), (3, 4), (5, 3)])
def test_zero3_shards_are_flat_zero_padded_slices_that_join_back(shards, length):
    weight = np.arange(1, 13, dtype=np.float32).reshape(3, 4)
    pieces = [take_shard(weight, shards, index) for index in range(shards)]
    assert [piece.shape for piece in pieces] == [(length,)] * shards
    joined = np.concatenate(pieces)
    np.testing.assert_array_equal(joined[12:], np.zeros(length * shards - 12, np.float32))
    np.testing.assert_array_equal(join_shards(joined, (3, 4)), weight)


@pytest.mark.parametrize("tied", [True, False])
def test_zero3_over_one_rank_keeps_paths_gradients_decay_and_whole_checkpoint_tensors(tied):
    params = params_with(*SMALL_MODEL, f"model.tie_embeddings={str(tied).lower()}")
    ms.set_seed(1)
    full = Llama(params.model)
    ms.set_seed(1)
    model = Llama(params.model)
    sharded = shard_parameters(model, comm.Group((0,), 0))
    assert named_weights(model).keys() == named_weights(full).keys()
    assert all(len(shard.shape) == 1 for shard in sharded.shards.values())

    rng = np.random.default_rng(0)
    tokens, labels = (ms.Tensor(rng.integers(0, 512, (2, 32)).astype(np.int32)) for _ in range(2))
    inputs = (tokens, labels, ms.Tensor(np.ones((2, 32), np.float32)), None, None, ms.Tensor(1.0))
    gradients = []
    for net in (full, model):
        accumulate = AccumulateGradients(net)
        accumulate(*inputs)
        names = {id(param): name for name, param in named_weights(net).items()}
        gradients.append({names[id(w)]: b.asnumpy().reshape(-1) for w, b in zip(accumulate.weights, accumulate.buffers)})
    for name, expected in gradients[0].items():
        if name == "embed_tokens.weight":
            # The whole model adds the looked-up rows' gradients into the table's buffer one token at a time (after
            # the tied head's); ZeRO-3's gathered table sums them first: the same terms in another order.
            np.testing.assert_allclose(gradients[1][name], expected, rtol=0, atol=1e-6 * np.abs(expected).max())
        else:
            np.testing.assert_array_equal(gradients[1][name], expected, err_msg=name)

    names = list(sharded.shards)
    unsharded = AdamW.from_params([named_weights(full)[n] for n in names], params.optimizer, names)
    placements = tuple(StatePlacement(n, PARAMETER_SHARD, "dp", False, False, "memory", sharded.decays[n])
                       for n in names)
    state = RankState(placements, {"dp": sharded.group}, tuple(range(len(names))), full_shapes=sharded.shapes)
    optimizer = AdamW.from_params([sharded.shards[n] for n in names], params.optimizer, names, state)
    assert optimizer.decays == unsharded.decays and any(unsharded.decays) and not all(unsharded.decays)
    moments = {key: rng.standard_normal(value.shape).astype(np.float32) for key, value in unsharded.state_dict().items()}
    optimizer.load_state_dict(moments)
    assert {k: v.tolist() for k, v in optimizer.state_dict().items()} == {k: v.tolist() for k, v in moments.items()}
    weights = {name: value + 1 for name, value in model_weights(full).items()}
    sharded.load_full_weights(weights)
    assert {k: v.tolist() for k, v in sharded.full_weights().items()} == {k: v.tolist() for k, v in weights.items()}
    with pytest.raises(ValueError, match=r"norm.weight has shape \(3,\), the model's is \(64,\)"):
        sharded.load_full_weights({**weights, "norm.weight": np.ones(3, np.float32)})


def test_log_tail_skips_framework_chatter(tmp_path):
    log = tmp_path / "worker_1.log"
    log.write_text("[INFO] noise\nTraceback (most recent call last):\n[WARNING] more\nValueError: boom\n")
    assert log_tail(log) == "Traceback (most recent call last):\nValueError: boom"
    assert "no log" in log_tail(tmp_path / "missing.log")


def test_the_data_position_is_global_so_a_checkpoint_resumes_under_another_dp_and_batch():
    rows = PackedRows(np.arange(40 * 3, dtype=np.int32).reshape(40, 3), np.zeros(40, np.int32), np.arange(41))
    single = ShuffledBatches(rows, global_batch_rows=8, seed=1)
    for _ in range(6):  # into the second epoch
        single.next_rows()
    state = single.state_dict()
    halves = [ShuffledBatches(rows, global_batch_rows=8, seed=1, rank=rank, world=2) for rank in (0, 1)]
    for half in halves:
        half.load_state_dict(state)
    expected = single.next_rows().tokens
    np.testing.assert_array_equal(np.concatenate([half.next_rows().tokens for half in halves]), expected)
    bigger = ShuffledBatches(rows, global_batch_rows=16, seed=1, rank=0, world=2)
    bigger.load_state_dict(state)  # the position counts samples: rank 0 of a batch of 16 takes the next 8
    np.testing.assert_array_equal(bigger.next_rows().tokens, expected)


def test_the_parallel_gradient_norm_counts_each_buffer_once_over_groups_of_one():
    import mindspore as ms
    from mindspore import Parameter, ParameterTuple, Tensor

    from model_core.parallel import comm
    from model_core.parallel.gradient_norm import ParallelGradientNorm

    rng = np.random.default_rng(3)
    values = [rng.standard_normal(shape).astype(np.float32) for shape in ((4, 3), (5,), (2, 2))]
    buffers = ParameterTuple(Parameter(Tensor(v), name=f"norm_test.{i}", requires_grad=False) for i, v in enumerate(values))
    alone = comm.group((0,))
    norm = ParallelGradientNorm(buffers, split=[True, False, True], counted=[True, True, False], tp_group=alone, shard_group=alone, pp_group=alone)
    expected = np.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in values[:2]))
    assert float(norm(Tensor(0.5, ms.float32)).asnumpy()) == pytest.approx(0.5 * expected, rel=1e-6)
