"""The probe behind parameter offload's design: can weights read from a file inside a jit-compiled step, with the
gradient taken through a buffer Parameter, lower peak RSS by the weights' bytes?

Twelve 2048 x 2048 fp32 matmul weights (192 MB) train one compiled forward + backward step, three times, in two
separate processes:
  param   the weights are Parameters of the step (and gradient buffers of their own), as without offload;
  fetch   the weights live in an unlinked file; a `pyfunc` Custom op reads each one inside the step when its layer
          runs (forward and backward), and a zero Parameter of the weight's shape stands in for it: the layer's
          bprop returns the weight's gradient as that Parameter's, which is also its gradient buffer.
It prints each process's peak RSS (VmHWM) and, last, one JSON object: `param_peak_rss_mb`, `fetch_peak_rss_mb`,
`weights_mb`, `saving_over_weights` ((param - fetch) / weights_mb) and `same_gradients` (bit for bit).

    python benchmarks/param_offload_probe.py
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile

LAYERS, WIDTH = 12, 2048
MB = 1e6


def main() -> None:
    if len(sys.argv) > 1:
        print(json.dumps(run(sys.argv[1])))
        return
    reports = {}
    for mode in ("param", "fetch"):
        done = subprocess.run([sys.executable, __file__, mode], check=True, capture_output=True, text=True)
        reports[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{mode}: peak RSS {reports[mode]['peak_rss_mb']:,.1f} MB", flush=True)
    weights_mb = LAYERS * WIDTH * WIDTH * 4 / MB
    saved = reports["param"]["peak_rss_mb"] - reports["fetch"]["peak_rss_mb"]
    print(json.dumps({
        "param_peak_rss_mb": reports["param"]["peak_rss_mb"], "fetch_peak_rss_mb": reports["fetch"]["peak_rss_mb"],
        "weights_mb": round(weights_mb, 1), "saving_over_weights": round(saved / weights_mb, 3),
        "same_gradients": reports["param"]["gradients"] == reports["fetch"]["gradients"],
    }))


def run(mode: str) -> dict:
    import mindspore as ms
    import numpy as np
    from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

    size = WIDTH * WIDTH
    rng = np.random.default_rng(0)
    initial = [rng.standard_normal(size, dtype=np.float32) * 0.02 for _ in range(LAYERS)]
    descriptor, path = tempfile.mkstemp()
    os.unlink(path)
    for index, weight in enumerate(initial):
        os.pwrite(descriptor, weight.tobytes(), index * size * 4)

    def reader(index):
        def read(_order):
            out = np.empty(size, np.float32)
            os.preadv(descriptor, [out], index * size * 4)
            return out
        return ops.Custom(read, out_shape=lambda _: (size,), out_dtype=lambda _: ms.float32, func_type="pyfunc")

    class Matmul(nn.Cell):
        def construct(self, x, weight):
            return ops.matmul(x, weight.reshape(WIDTH, WIDTH))

        def bprop(self, x, weight, out, dout):
            full = weight.reshape(WIDTH, WIDTH)
            return ops.matmul(dout, full.T), ops.matmul(x.T, dout).reshape(-1)

    class FetchedMatmul(nn.Cell):
        def __init__(self, index):
            super().__init__()
            self.read = reader(index)

        def construct(self, x, buffer):
            return ops.matmul(x, self.read(ops.depend(buffer[:1], x)).reshape(WIDTH, WIDTH))

        def bprop(self, x, buffer, out, dout):
            weight = self.read(ops.depend(buffer[:1], dout)).reshape(WIDTH, WIDTH)
            return ops.matmul(dout, weight.T), ops.matmul(x.T, dout).reshape(-1)

    class Layer(nn.Cell):
        def __init__(self, index):
            super().__init__()
            value = initial[index] if mode == "param" else np.zeros(size, np.float32)
            self.weight = Parameter(Tensor(value), name=f"w{index}")
            self.matmul = Matmul() if mode == "param" else FetchedMatmul(index)

        def construct(self, x):
            return ops.tanh(self.matmul(x, self.weight))

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = nn.CellList([Layer(i) for i in range(LAYERS)])

        def construct(self, x):
            for layer in self.layers:
                x = layer(x)
            return x.sum()

    net = Net()
    weights = ParameterTuple(net.trainable_params())
    buffers = weights if mode == "fetch" else ParameterTuple(
        Parameter(Tensor(np.zeros(size, np.float32)), name=f"g{i}", requires_grad=False) for i in range(LAYERS)
    )

    class Step(nn.Cell):
        def __init__(self):
            super().__init__()
            self.buffers = buffers
            self.value_and_grad = ops.value_and_grad(net, None, weights)

        @ms.jit
        def construct(self, x):
            loss, grads = self.value_and_grad(x)
            for buffer, grad in zip(self.buffers, grads):
                ops.assign_add(buffer, grad)
            return loss

    step = Step()
    x = Tensor(rng.standard_normal((64, WIDTH), dtype=np.float32))
    for _ in range(3):
        step(x).asnumpy()
    digest = hashlib.sha256(b"".join(buffer.asnumpy().tobytes() for buffer in buffers)).hexdigest()
    with open("/proc/self/status") as status:
        peak_kb = int(next(line for line in status if line.startswith("VmHWM:")).split()[1])
    return {"peak_rss_mb": round(peak_kb * 1024 / MB, 1), "gradients": digest}


if __name__ == "__main__":
    main()
