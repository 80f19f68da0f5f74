"""One replica's micro-batches in the GPipe training step (``strata.worker.trainers.gpipe``,
traced inside its ``tf.function``): ``ReplicaSchedule`` reads the replica's layer state and
16-bit weight copies, runs every micro-batch forward through the stages (in order within a
stage) and then backward in reverse micro-batch order, summing each stage's parameter
gradients into one float32 accumulator per stage (``acc``; ``state``: the layer state the
step leaves). Control dependencies fix the order within each stage task and bound what a
stage holds; nothing orders different tasks, which is where the pipeline overlap comes from.
With ``recompute`` the forward keeps only each stage's input and the backward re-runs it under
a tape.
"""

from __future__ import annotations

from typing import Any, Callable

from strata.worker.trainers.gpipe_stages import Stage, run_layers


class ReplicaSchedule:
    """One replica's forward and backward passes in one step (see the module). ``mb_loss``
    turns the last stage's output and labels into the micro-batch's share of the replica's
    mean loss; ``scale`` is the float16 loss scale (None: unscaled)."""

    def __init__(self, tf: Any, row: list[Stage], recompute: bool,
                 mb_loss: Callable[[Any, Any], Any], scale: Any):
        self.tf, self.row, self.recompute = tf, row, recompute
        self.mb_loss, self.scale = mb_loss, scale
        self.S = len(row)
        self.acc: list[Any] = [None] * self.S     # per stage: the summed gradients
        self.state: list[Any] = []   # per stage: its layers' state, threaded micro-batch to micro-batch
        self.casts: list[dict] = []  # per stage: id(variable) -> its 16-bit copy for this step
        self.sources: list[list] = []  # per stage: what its gradients are taken with respect to
        self.saved: dict = {}  # (s, i): what the backward of stage s, micro-batch i needs
        self.prev: list[Any] = [None] * self.S  # per stage: its last forward's result
        self.done: dict = {}  # (s, i): stage s has summed micro-batch i's gradients
        self.sent_back: dict = {}  # (s, i): the gradient of stage s's input for micro-batch i
        self._read_state()

    def _read_state(self) -> None:
        tf = self.tf
        for st in self.row:
            with tf.device(st.device):
                self.state.append([[v.value for v in vs] for vs in st.nt])
                # one 16-bit copy of each weight per step, shared by the micro-batches
                # (Keras would cast on every call, and each micro-batch's tape would keep
                # its own copy until its backward pass)
                c = {id(v): tf.cast(v.value, st.casts[id(v)]) for v in st.tvars
                     if id(v) in st.casts}
            self.casts.append(c)
            self.sources.append([c.get(id(v), v) for v in st.tvars])

    def _run_taped(self, s: int, h_in: Any, nt_in: list, y_mb: Any) -> tuple:
        """Stage ``s`` on ``h_in`` under a new tape (watching its 16-bit weight copies and,
        past the first stage, its input): (tape, output, new state, loss, loss to
        differentiate); the losses only on the last stage."""
        tf, st = self.tf, self.row[s]
        loss = target = None
        tape = tf.GradientTape()
        with tape:
            tape.watch(list(self.casts[s].values()) + ([h_in] if s > 0 else []))
            out, new = run_layers(st, h_in, nt_in, self.casts[s], True)
            if s == self.S - 1:
                loss = self.mb_loss(out, y_mb)
                target = loss * self.scale if self.scale is not None else loss
        return tape, out, new, loss, target

    # -- forward

    def forward(self, xs: list, ys: list) -> list:
        """Micro-batch i through every stage, i in order; returns the micro-batches' losses."""
        losses = []
        for i, (h, y_mb) in enumerate(zip(xs, ys)):
            for s in range(self.S):
                h = self._forward_stage(s, i, h, y_mb)
            losses.append(self.saved[(self.S - 1, i)][4])
        return losses

    def _forward_stage(self, s: int, i: int, h: Any, y_mb: Any) -> Any:
        tf, st = self.tf, self.row[s]
        last = s == self.S - 1
        deps = [self.prev[s]] if self.prev[s] is not None else []
        with tf.device(st.device), tf.control_dependencies(deps):
            h_in = tf.identity(h)
            nt_in = self.state[s]
            loss = target = None
            if self.recompute:
                tape = None
                out, self.state[s] = run_layers(st, h_in, nt_in, self.casts[s], True)
                if last:
                    loss = self.mb_loss(out, y_mb)
            else:
                tape, out, self.state[s], loss, target = self._run_taped(s, h_in, nt_in, y_mb)
        self.saved[(s, i)] = (h_in, nt_in, tape, out, loss, target)
        self.prev[s] = loss if last else out
        return out

    # -- backward

    def backward(self, ys: list) -> None:
        """Reverse micro-batch order (GPipe); one micro-batch's gradients at a time."""
        for i in reversed(range(len(ys))):
            dy = None
            for s in reversed(range(self.S)):
                dy = self._backward_stage(s, i, dy, ys[i])

    def _backward_deps(self, s: int, i: int) -> list:
        """What stage ``s``'s backward of micro-batch ``i`` waits for."""
        deps = list(self.acc[s]) if self.acc[s] is not None else []
        if (s, i + 1) in self.sent_back:
            # and for the gradient of its input that the previous micro-batch
            # sends back: the weights' gradients can be summed before it is
            # made, and this micro-batch's backward would run beside it.
            # Measured on conv-small's last stage (max pool, dense; hybrid
            # 2 x 2, batch 128): 60-81 MiB against a 65 MiB estimate and an
            # 82 MiB budget before, 51-57 after; pipeline throughput 0.90-1.03
            # of the unheld one on 2 cores
            deps.append(self.sent_back[(s, i + 1)])
        if self.recompute and not deps:
            # the first re-run waits for the stage's last forward: its input
            # is there from the start (the first stage's) or early, and run
            # beside the forwards its activations would sit on top of theirs.
            # It cannot finish before that anyway (its output gradient comes
            # after every forward), so this costs no time.
            deps = [self.prev[s]]
        if s > 0 and (s - 1, i + 2) in self.done:
            # the gradient this sends back waits until the stage below has
            # finished micro-batch i + 2. A stage receives its output's
            # gradients as soon as they are made (TF posts every Recv at the
            # start of the step), so without this a lagging stage collects
            # all M of them; with it, at most two (the one it is working on
            # and the next), which is what the stage estimate counts
            # (docs/memory.md, "Pipeline stages"). Before this and the re-run's wait
            # above, a recomputing first stage once peaked 6.5 MiB over its
            # estimate (three of its 1024 x 512 gradients' worth). In GPipe's
            # schedule the stage below finished i + 2 a slot before this
            # starts; measured on 2 cores, 0.93-1.0 of the throughput without
            # it (one small control message per micro-batch and stage).
            deps.append(self.done[(s - 1, i + 2)])
        return deps

    def _backward_stage(self, s: int, i: int, dy: Any, y_mb: Any) -> Any:
        """Stage ``s``'s backward of micro-batch ``i`` given its output's gradient ``dy``;
        sums its parameter gradients and returns its input's gradient (None on stage 0)."""
        tf, st = self.tf, self.row[s]
        last = s == self.S - 1
        h_in, nt_in, tape, out, loss, target = self.saved.pop((s, i))
        deps = self._backward_deps(s, i)
        with tf.device(st.device), tf.control_dependencies(deps):
            if self.recompute:
                # re-run this micro-batch's forward from its kept input and state
                tape, out, _, _, target = self._run_taped(s, h_in, nt_in, y_mb)
            if last:
                out_grad = None
            else:
                target, out_grad = out, dy
            grads = tape.gradient(target, ([h_in] if s > 0 else []) + self.sources[s],
                                  output_gradients=out_grad)
            if s > 0:
                dy, grads = grads[0], grads[1:]
                self.sent_back[(s, i)] = dy
            self._accumulate(s, i, grads)
        return dy

    def _accumulate(self, s: int, i: int, grads: list) -> None:
        """Micro-batch ``i``'s gradients into stage ``s``'s accumulator."""
        tf, st = self.tf, self.row[s]
        # float32 gradients (a 16-bit copy's gradient cast back, as the
        # gradient of Keras' own cast would be)
        grads = [tf.zeros_like(v) if g is None else
                 tf.cast(tf.convert_to_tensor(g), v.dtype)
                 for g, v in zip(grads, st.tvars)]
        self.acc[s] = grads if self.acc[s] is None else \
            [a + g for a, g in zip(self.acc[s], grads)]
        if s < self.S - 1:
            self.done[(s, i)] = tf.group(*self.acc[s])
