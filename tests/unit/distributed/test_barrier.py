"""store_barrier on an in-process HashStore: the error message, the shared verdict and key cleanup."""

from __future__ import annotations

import threading

import pytest
from torch.distributed import HashStore

from lifecycle.distributed.barrier import store_barrier
from lifecycle.errors import ExitCode, HangError


def test_timeout_names_missing_ranks() -> None:
    store = HashStore()
    with pytest.raises(HangError, match=r"^barrier 'after_init' on group 'world' timed out after 0\.2s: "
                                        r"ranks \[1, 2, 3\] did not arrive$") as info:
        store_barrier(store, "after_init", 0, [0, 1, 2, 3], 0.2, phase="init", group="world")
    err = info.value
    assert (err.missing, err.rank, err.phase, err.group, err.deadline_s) == ([1, 2, 3], 0, "init", "world", 0.2)
    assert err.exit_code == ExitCode.HANG


def test_late_rank_gets_the_same_verdict() -> None:
    store = HashStore()
    with pytest.raises(HangError):
        store_barrier(store, "b/0", 0, [0, 1], 0.1)
    # Arriving after the verdict fails too (never passes alone), and says that this rank was late.
    with pytest.raises(HangError, match=r"ranks \[1\] did not arrive \(this rank, 1, arrived after") as info:
        store_barrier(store, "b/0", 1, [0, 1], 5.0)
    assert info.value.missing == [1]


def test_all_arrive_and_keys_are_deleted() -> None:
    store = HashStore()
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            for seq in range(5):
                store_barrier(store, f"barrier/step/{seq}", rank, [0, 1, 2], 10.0)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    assert store.num_keys() == 0


def test_rank_must_be_a_member() -> None:
    with pytest.raises(ValueError, match="rank 5 is not one of the ranks"):
        store_barrier(HashStore(), "k", 5, [0, 1], 1.0)


def test_unreachable_store_says_who_hosts_it() -> None:
    import datetime

    from torch.distributed import TCPStore

    from lifecycle.errors import PhaseError

    server = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=5))
    del server  # the host is gone, as when rank 0 hosted it and died
    with pytest.raises(PhaseError, match="the store is unreachable .* died with rank 0") as info:
        store_barrier(client, "b/0", 1, [0, 1], 5.0, phase="init")
    assert not isinstance(info.value, HangError) and info.value.phase == "init"
