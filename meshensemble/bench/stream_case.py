"""The ``stream`` bench case: the training loop's streamed input (``--input stream``).

Each call runs ``K`` steps exactly as :func:`meshensemble.training.train` runs them with
``--input stream``: one compiled step per call of :meth:`meshensemble.training.Feeder.run`,
the batch's rows read on the host by Grain threads ahead of the step and assembled with
``jax.make_array_from_process_local_data``. Against ``chunk_default`` (the on-device
loop as the platform runs it by default, same model, members, mesh and batch) it gives
``ratios["stream_over_device_steps_per_s"]``.

Example:
  $ meshensemble bench --cases chunk,stream
"""

from __future__ import annotations

import jax

from meshensemble.bench.cases import Runner


class StreamSteps(Runner):
    """``K`` streamed steps of the training loop per call (Grain prefetch, host rows).

    Args:
      ctx: the bench's shared workloads.
      spec: the case (``kind="stream"``; ``k`` steps per call).

    Example:
      >>> from meshensemble.bench import Spec
      >>> runner = StreamSteps(ctx, Spec("stream", "mlp32", members=2, devices=2, ensemble=2, k=2))
      >>> runner.prepare(); runner.run()
      >>> runner.compile_s > 0
      True
    """

    def build(self) -> None:
        _, self.feeder = self.make_feeder(1, input="stream")
        self.epoch, self.step = 1, 0

    def run(self) -> None:
        metrics = None
        for _ in range(self.spec.k):
            self.state, metrics = self.feeder.run(self.state, self.epoch, self.step, 1)
            self.step += 1
            if self.step == self.ctx.steps_per_epoch:
                self.epoch, self.step = self.epoch + 1, 0
        jax.block_until_ready((self.state, metrics))
