"""The children of ``rayload.spawn`` from a rank actor's start-up times (no Ray)."""

from __future__ import annotations

from rayload.tracing import schema
from rayload.tracing.spawn_spans import SpawnPhase, SpawnTimes, spawn_phases

IMPORTS = [("torch", 300, 700), ("rayload", 700, 800)]


def _names(phases: tuple[SpawnPhase, ...]) -> list[str]:
    return [p.name for p in phases]


def test_spawn_phases_cover_the_spawn_contiguously_for_a_new_worker() -> None:
    times = SpawnTimes(process_start_ns=100, imports=IMPORTS, init_start_ns=820)
    phases = spawn_phases(0, 1000, times)
    assert _names(phases) == [
        schema.SPAWN_WORKER_WAIT_SPAN,
        schema.SPAWN_PROCESS_START_SPAN,
        schema.SPAWN_IMPORTS_SPAN,
        schema.SPAWN_ACTOR_INIT_SPAN,
    ]
    assert [(p.start_ns, p.end_ns) for p in phases] == [
        (0, 100),
        (100, 300),
        (300, 800),
        (800, 1000),
    ]
    imports = phases[2]
    assert [(c.name, c.start_ns, c.end_ns) for c in imports.children] == [
        ("rayload.spawn.import.torch", 300, 700),
        ("rayload.spawn.import.rayload", 700, 800),
    ]


def test_spawn_phases_of_a_prestarted_worker_wait_until_its_first_import() -> None:
    times = SpawnTimes(process_start_ns=-5000, imports=IMPORTS, init_start_ns=820)
    phases = spawn_phases(0, 1000, times)
    assert _names(phases)[0] == schema.SPAWN_WORKER_WAIT_SPAN
    assert (phases[0].start_ns, phases[0].end_ns) == (0, 300)
    assert phases[0].attributes == {"worker_started_before_spawn": True}
    assert schema.SPAWN_PROCESS_START_SPAN not in _names(phases)


def test_spawn_phases_clamp_skewed_times_into_the_spawn_and_keep_order() -> None:
    # A rank's corrected times may be off by up to rtt/2: before the spawn or after it.
    times = SpawnTimes(
        process_start_ns=None,
        imports=[("torch", -50, 400), ("rayload", 380, 1200)],
        init_start_ns=1100,
        cuda_context=(1150, 1300),
    )
    phases = spawn_phases(0, 1000, times)
    for phase in phases:
        assert 0 <= phase.start_ns <= phase.end_ns <= 1000
        for child in phase.children:
            assert phase.start_ns <= child.start_ns <= child.end_ns <= phase.end_ns
    assert phases[-1].end_ns == 1000 or phases[-1].name == schema.SPAWN_IMPORTS_SPAN


def test_spawn_phases_put_the_cuda_context_inside_actor_init() -> None:
    times = SpawnTimes(
        process_start_ns=None, imports=IMPORTS, init_start_ns=820, cuda_context=(830, 950)
    )
    (*_, init) = spawn_phases(0, 1000, times)
    assert init.name == schema.SPAWN_ACTOR_INIT_SPAN
    assert [(c.name, c.start_ns, c.end_ns) for c in init.children] == [
        (schema.SPAWN_CUDA_CONTEXT_SPAN, 830, 950)
    ]


def test_spawn_phases_put_torch_child_imports_inside_its_import_clipped() -> None:
    # The first child starts before torch's import (clock error) and the last ends after.
    children = [
        ("torch", "torch._C", 290, 450),
        ("torch", "torch.functional", 460, 600),
        ("torch", "torch.export", 610, 720),
        ("rayload", "rayload.loading", 710, 790),
    ]
    times = SpawnTimes(
        process_start_ns=100, imports=IMPORTS, init_start_ns=820, import_children=children
    )
    imports = spawn_phases(0, 1000, times)[2]
    torch_import, rayload_import = imports.children
    assert [(c.name, c.start_ns, c.end_ns, c.attributes) for c in torch_import.children] == [
        ("rayload.spawn.import.torch._C", 300, 450, {"module": "torch._C"}),
        ("rayload.spawn.import.torch.functional", 460, 600, {"module": "torch.functional"}),
        ("rayload.spawn.import.torch.export", 610, 700, {"module": "torch.export"}),
    ]
    assert [c.name for c in rayload_import.children] == ["rayload.spawn.import.rayload.loading"]
    assert torch_import.attributes == {"package": "torch"}


def test_spawn_phases_leave_out_child_imports_clipped_to_nothing() -> None:
    times = SpawnTimes(
        process_start_ns=100,
        imports=IMPORTS,
        init_start_ns=820,
        import_children=[("torch", "torch._C", 100, 250), ("torch", "torch.nn", 400, 500)],
    )
    torch_import = spawn_phases(0, 1000, times)[2].children[0]
    assert [c.name for c in torch_import.children] == ["rayload.spawn.import.torch.nn"]
