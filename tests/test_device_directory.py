"""The cache's directory in device memory (`DeviceDirectory`) with the Triton kernels reading and
stepping rows where they live: against a reference set-associative cache written plainly,
against training the whole table, and as a step a CUDA graph can record (no host read, the
same ops and shapes for any ids). On a CPU the kernels run under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

triton_tbe = pytest.importorskip("lightning_hotcache.kernels.triton_tbe")
if triton_tbe.why_unavailable(torch.device("cuda" if torch.cuda.is_available() else "cpu")) is not None:
    pytest.skip("Triton cannot run here (not installed, or a CPU without TRITON_INTERPRET=1)", allow_module_level=True)

from lightning_hotcache._ops.step_graph import HostReadInGraph, _OpTrace  # noqa: E402
from lightning_hotcache._ops.switches import Switch  # noqa: E402
from lightning_hotcache.cache.device_directory import NO_READ, DeviceDirectory  # noqa: E402
from lightning_hotcache.cache.host_mapping import map_for_devices  # noqa: E402
from lightning_hotcache.optim.rowwise import RowWiseOptimizerConfig  # noqa: E402
from test_triton_tbe import initial_state, reference_step  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.kernels

ROWS, DIM = 90, 6


def zipf_ids(n: int, generator: torch.Generator, rows: int = ROWS) -> torch.Tensor:
    """Skewed ids with repeats, the last row among them."""
    weights = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64)
    ids = torch.multinomial(weights, n, replacement=True, generator=generator)
    ids[0] = rows - 1
    return ids


def arrays(rows: int, rule: str, generator: torch.Generator) -> dict[str, torch.Tensor]:
    return {"weight": torch.randn(rows, DIM, generator=generator), **initial_state(rule, rows, DIM, generator)}


def directory_over(host: dict[str, torch.Tensor], static_ids: torch.Tensor, dynamic: int, policy: str, ways: int, window: int = 0):
    if DEVICE.type == "cuda":  # host rows the kernels reach: page-locked and mapped, as the collection's
        for array in host.values():
            map_for_devices(array)
    slots = {key: torch.full((len(static_ids) + dynamic, a.shape[1]), float("nan"), device=DEVICE) for key, a in host.items()}
    for key in slots:
        slots[key][: len(static_ids)] = host[key][static_ids].to(DEVICE)
    window = window or (3 if policy == "lookahead" else 0)
    return DeviceDirectory(static_ids, dynamic, policy, slots, host, ways=ways, window_batches=window)


class ReferenceCache:
    """The same set-associative rules, one id at a time in Python."""

    def __init__(self, static_ids, num_sets, ways, policy, set_of):
        self.static = {int(i): k for k, i in enumerate(static_ids)}
        self.sets = [[None] * ways for _ in range(num_sets)]  # each way: [id, reads, last use, holders]
        self.ways, self.policy, self.set_of, self.tick = ways, policy, set_of, 0
        self.pending: list[tuple[int, set[int]]] = []  # lookahead: announced batches not yet admitted
        self.announced = 0

    def announce(self, ids):
        self.pending.append((self.announced, set(ids.tolist())))
        self.announced += 1

    def admit(self, ids, training=True):
        """Each distinct id's place: ("static", slot), ("cell", cell) or ("host", None)."""
        self.tick += 1
        if training and self.pending:  # the oldest announced batch is this one
            self.pending.pop(0)
        distinct = sorted(set(ids.tolist()))
        places, held = {}, []
        misses = []
        for i in distinct:
            if i in self.static:
                places[i] = ("static", self.static[i])
                continue
            s = int(self.set_of(torch.tensor([i]))[0])
            way = next((w for w, e in enumerate(self.sets[s]) if e is not None and e[0] == i), None)
            if way is None:
                misses.append((i, s))
                continue
            entry = self.sets[s][way]
            entry[1], entry[2], entry[3] = entry[1] + 1, self.tick, entry[3] + 1
            places[i] = ("cell", s * self.ways + way)
            held.append(entry)
        scores = {}
        for i, s in misses:  # the set's ways by score as the batch found them, hits held
            if s not in scores:
                def score(w):
                    e = self.sets[s][w]
                    if e is None:
                        return -1
                    if e[3] > 0:
                        return None
                    ahead = [a for a, batch in self.pending if e[0] in batch]
                    if self.policy == "lookahead" and ahead:  # after every unread row, farthest read first
                        return (1 << 62) + (1 << 40) - min(ahead)
                    return (e[1] << 40) + e[2] if self.policy in ("lfu", "lookahead") else e[2]
                free = [w for w in range(self.ways) if score(w) is not None]
                scores[s] = sorted(free, key=lambda w: (score(w), w))
            if scores[s]:
                way = scores[s].pop(0)
                entry = [i, 1, self.tick, 1]
                self.sets[s][way] = entry
                places[i] = ("cell", s * self.ways + way)
                held.append(entry)
            else:
                places[i] = ("host", None)
        return places, held

    def release(self, held):
        for entry in held:
            entry[3] -= 1
        if self.policy == "static":
            for ways in self.sets:
                for w, e in enumerate(ways):
                    if e is not None and e[3] == 0:
                        ways[w] = None


POLICIES = ["lru", "lfu", "static", "lookahead"]


def cases(values: list[str], fast: set[tuple[str, str]]) -> list:
    """``policy`` x ``values`` as ``pytest.param``s, those outside ``fast`` marked ``full``."""
    return [pytest.param(p, v, marks=() if (p, v) in fast else pytest.mark.full) for p in POLICIES for v in values]


# Every policy with the set kernels (CUDA's default), and the other two ways to find and choose by a policy each.
@pytest.mark.parametrize(
    ("policy", "sets"),
    cases(["kernels", "kernels-3-ways", "torch-ops"],
          {*((p, "kernels") for p in POLICIES), ("lfu", "kernels-3-ways"), ("lookahead", "torch-ops"), ("lru", "torch-ops")}),
)  # fmt: skip
def test_the_directory_places_rows_as_a_plain_set_associative_cache_does(policy, sets, monkeypatch):
    """Under lookahead each training batch is announced three batches ahead, and every fifth
    batch is an evaluation batch, announced never (its admission retires nothing). Ids found and
    victims chosen by `set_kernels` (also with sets of 3 ways: fewer than their block of ways), or
    by the torch ops they replace (`Switch.SET_KERNELS`)."""
    monkeypatch.setenv(Switch.SET_KERNELS.variable, "0" if sets == "torch-ops" else "1")
    generator = torch.Generator().manual_seed(3)
    host = arrays(ROWS, "sgd", generator)
    static_ids = torch.tensor([0, 1, 5])
    directory = directory_over(host, static_ids, dynamic=12, policy=policy, ways=3 if sets == "kernels-3-ways" else 4)
    assert directory.set_kernels == (sets != "torch-ops")
    reference = ReferenceCache(static_ids, directory.num_sets, directory.ways, policy, directory.set_of)
    in_flight = []
    saw_host = saw_hit = False
    trace = [(zipf_ids(24, generator), step % 5 != 4 or policy != "lookahead") for step in range(30)]
    training_batches = [ids for ids, training in trace if training]
    ahead = 3 if policy == "lookahead" else 0
    for ids in training_batches[:ahead]:
        directory.announce(ids.to(DEVICE))
        reference.announce(ids)
    announced = ahead
    for step, (ids, training) in enumerate(trace):
        admission = directory.admit(ids.to(DEVICE), training=training)
        places, held = reference.admit(ids, training)
        if training and ahead and announced < len(training_batches):  # the loader reads the next one
            directory.announce(training_batches[announced].to(DEVICE))
            reference.announce(training_batches[announced])
            announced += 1
        locations = admission.locations.cpu()
        for k, i in enumerate(ids.tolist()):
            kind, where = places[i]
            if kind == "static":
                assert locations[k] == where
            elif kind == "cell":
                assert locations[k] == where + len(static_ids), (step, i)
                assert directory.ids[where] == i
            else:
                assert locations[k] == -i - 1
                saw_host = True
        saw_hit |= any(kind == "cell" for kind, _ in places.values()) and step > 0
        in_flight.append((admission, held))
        if len(in_flight) == 2:  # two batches in flight: the older one's cells stay held meanwhile
            old, old_held = in_flight.pop(0)
            directory.release(old)
            reference.release(old_held)
    assert saw_host and saw_hit


# Every policy and every rule, each rule under two policies (the rules' arithmetic is the kernels'
# tests'; here the arrays each moves with its row).
@pytest.mark.parametrize(
    ("policy", "rule"),
    cases(["sgd", "rowwise_adagrad", "adam"],
          {("lru", "sgd"), ("lfu", "rowwise_adagrad"), ("static", "adam"), ("lookahead", "adam"), ("lookahead", "sgd"), ("lru", "rowwise_adagrad")}),
)  # fmt: skip
def test_training_through_the_device_directory_equals_training_the_whole_table(policy, rule):
    """A cache of 8 dynamic slots in sets of 4 over a batch of about 20 distinct rows: rows
    hit, get evicted dirty and come back, and lose conflicts to the host; every pooled row and,
    after `flush`, every row and its state equal the whole table's (under lookahead, training
    batches announced two ahead)."""
    generator = torch.Generator().manual_seed(11)
    config = RowWiseOptimizerConfig(name=rule, lr=0.05)
    whole = arrays(ROWS, rule, generator)
    host = {k: v.clone() for k, v in whole.items()}
    directory = directory_over(host, torch.tensor([0, 2]), dynamic=8, policy=policy, ways=4)
    batch = 10
    steps = []
    for step in range(12):
        lengths = torch.randint(0, 4, (2 * batch,), generator=generator)
        steps.append((lengths, zipf_ids(int(lengths.sum()), generator), step % 4 != 3))  # an evaluation batch now and then
    ahead = [indices for _, indices, training in steps if training] if policy == "lookahead" else []
    for indices in ahead[:2]:
        directory.announce(indices.to(DEVICE))
    for lengths, indices, training in steps:
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        bag_mean = (torch.arange(2 * batch) >= batch).to(torch.int32)  # the second feature pools by mean
        per_sample = torch.rand(indices.numel(), generator=generator) + 0.5
        grad = torch.randn(2 * batch, DIM, generator=generator)
        admission = directory.admit(indices.to(DEVICE), training=training)
        if training and directory.announced < len(ahead):
            directory.announce(ahead[directory.announced].to(DEVICE))
        got = triton_tbe.pooled(
            directory.slots["weight"], admission.locations, offsets.to(DEVICE), bag_mean.to(DEVICE), per_sample.to(DEVICE),
            host_weight=host["weight"],
        )  # fmt: skip
        want = triton_tbe.pooled(whole["weight"], indices, offsets, bag_mean, per_sample)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)
        if training:
            triton_tbe.backward_step(
                directory.slots["weight"], grad.to(DEVICE), admission.locations, offsets.to(DEVICE), rule, config.lr, config.eps,
                directory.slots, bag_mean.to(DEVICE), per_sample.to(DEVICE), host["weight"], host,
            )  # fmt: skip
            reference_step(rule, whole["weight"], {k: v for k, v in whole.items() if k != "weight"}, grad, indices, offsets, bag_mean,
                           per_sample, config.lr)  # fmt: skip
        directory.release(admission)
    counters = directory.counters()
    assert counters["fetched_rows"] > directory.num_cells and counters["written_back_rows"] > 0 and counters["from_host_rows"] > 0
    directory.flush()
    for key in whole:
        torch.testing.assert_close(host[key], whole[key], rtol=1e-6, atol=1e-6)


def test_rows_read_only_in_evaluation_are_not_written_back():
    generator = torch.Generator().manual_seed(5)
    host = arrays(ROWS, "sgd", generator)
    directory = directory_over(host, torch.tensor([], dtype=torch.int64), dynamic=4, policy="lru", ways=4)
    for _ in range(6):
        directory.release(directory.admit(torch.randint(0, ROWS, (8,), generator=generator).to(DEVICE), training=False))
    counters = directory.counters()
    assert counters["fetched_rows"] > 4 and counters["written_back_rows"] == 0


@pytest.mark.parametrize("policy", ["lfu", "lookahead"])
def test_a_step_through_the_directory_reads_nothing_back_and_keeps_its_ops_and_shapes(policy):
    """What a CUDA graph needs of the admission: no op that makes the host wait, and the same
    ops with the same shapes whatever the ids (all one row, or all distinct); under lookahead
    whether or not the batch was announced (the loader announces outside the step)."""
    generator = torch.Generator().manual_seed(1)
    host = arrays(ROWS, "rowwise_adagrad", generator)
    directory = directory_over(host, torch.tensor([3, 4]), dynamic=16, policy=policy, ways=8)
    offsets = torch.arange(0, 33, 4, device=DEVICE)
    traces = []
    for k, ids in enumerate((torch.full((32,), 7), torch.arange(32) * 2, zipf_ids(32, generator))):
        if policy == "lookahead" and k != 1:
            directory.announce(ids.to(DEVICE))
        trace = _OpTrace()
        with trace:
            admission = directory.admit(ids.to(DEVICE), training=True)
            triton_tbe.pooled(directory.slots["weight"], admission.locations, offsets, host_weight=host["weight"])
            directory.release(admission)
        traces.append(trace.ops)
    assert traces[0] == traces[1] == traces[2]
    with pytest.raises(HostReadInGraph):  # the trace does refuse a host read
        with _OpTrace():
            admission.locations.max().item()


def test_announced_ids_beyond_the_window_width_are_counted_not_kept():
    """The window's width is set by the first announcement (1.5 times its distinct ids outside
    the static rows, at least 64); a later batch with more leaves its largest ids out, and says
    how many: they cost hits, never a wrong row."""
    rows = 500
    host = arrays(rows, "sgd", torch.Generator().manual_seed(0))
    directory = directory_over(host, torch.tensor([0]), dynamic=8, policy="lookahead", ways=4)
    directory.announce(torch.tensor([0, 3, 3, 9], device=DEVICE))  # two distinct ids outside the static row
    assert directory.window.shape[1] == 64
    directory.announce(torch.arange(1, 101, device=DEVICE))  # 100 distinct ids
    assert directory.counters()["window_dropped_ids"] == 36
    assert directory.window[1].tolist() == list(range(1, 65))
    directory.release(directory.admit(torch.arange(1, 101, device=DEVICE), training=True))
    directory.release(directory.admit(torch.arange(1, 101, device=DEVICE), training=True))
    assert int(directory.retired) == 2


def test_a_cleared_window_forgets_the_batches_never_admitted_and_numbers_the_next_ones_on():
    """An epoch cut short leaves announced batches never admitted: `clear_window` drops them, so
    that the next batch announced is the next one admitted (it retires its own announcement, and
    rows only the dropped batches read are no longer kept for them)."""
    host = arrays(ROWS, "sgd", torch.Generator().manual_seed(0))
    directory = directory_over(host, torch.tensor([], dtype=torch.int64), dynamic=8, policy="lookahead", ways=8)
    for ids in ([1, 2], [3, 4], [5, 6]):
        directory.announce(torch.tensor(ids, device=DEVICE))
    directory.release(directory.admit(torch.tensor([1, 2, 3], device=DEVICE), training=True))
    assert int(directory.retired) == 1 and directory.next_read[directory.ids == 3].tolist() == [1]  # batch 1 reads row 3
    directory.clear_window()
    assert int(directory.retired) == 3 and directory.next_read.eq(NO_READ).all()
    directory.announce(torch.tensor([7], device=DEVICE))
    directory.release(directory.admit(torch.tensor([7], device=DEVICE), training=True))
    assert int(directory.retired) == 4  # its own announcement, numbered after the dropped ones


def test_bad_directories_are_refused_with_the_reason():
    slots = {"weight": torch.zeros(4, DIM)}
    with pytest.raises(ValueError, match="lookahead"):
        DeviceDirectory(torch.tensor([], dtype=torch.int64), 4, "lookahead", slots, {"weight": torch.zeros(ROWS, DIM)})
    with pytest.raises(ValueError, match="same arrays"):
        DeviceDirectory(torch.tensor([], dtype=torch.int64), 4, "lru", slots, {"momentum": torch.zeros(ROWS, 1)})
    with pytest.raises(ValueError, match="do not fit"):
        DeviceDirectory(torch.tensor([0, 1]), 4, "lru", slots, {"weight": torch.zeros(ROWS, DIM)})
