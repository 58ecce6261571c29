"""KernelHolds alone: what the mount takes the kernel's page cache to hold, learnt from opens and reads."""

from fanstore.mount.kernel_holds import KernelHolds


def test_a_file_is_held_once_sent_whole_until_read_from_its_start():
    holds = KernelHolds(3)
    assert not holds.holds(0)
    holds.sent_whole(0)
    assert holds.holds(0) and not holds.holds(1)
    holds.opened(0)
    holds.read_from_start(0)
    assert not holds.holds(0)


def test_flags_are_trusted_only_while_reopened_files_turn_out_held():
    count = 64
    holds = KernelHolds(count)
    for entry in range(count):
        holds.sent_whole(entry)
    # The kernel drops what it was given: each reopened file is read again. The flags soon stop being trusted, for
    # the files not reopened yet too.
    for entry in range(12):
        holds.opened(entry)
        holds.read_from_start(entry)
        holds.released(entry)
        holds.sent_whole(entry)
    assert holds.trust < 0.5
    assert not any(holds.holds(entry) for entry in range(count))
    # Memory is free again: reopened files are answered by the kernel (released unread), and trusted again.
    for entry in range(count):
        holds.opened(entry)
        holds.released(entry)
    assert holds.trust > 0.9
    assert all(holds.holds(entry) for entry in range(count))


def test_opens_of_files_never_sent_teach_nothing():
    holds = KernelHolds(2)
    for _ in range(100):
        holds.opened(1)
        holds.read_from_start(1)
        holds.released(1)
    assert holds.trust == 1.0
