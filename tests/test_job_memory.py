"""How much memory a job may use (fanstore/mount/job_memory.py), read from /proc and /sys trees built here: cgroup v1 and
v2, limits on the job's cgroup or above it, page cache that counts as room, containers whose cgroup mount starts
below the root, and what the mount's cache default makes of the answer.

A real job in a real memory cgroup runs in tests/test_serve.py."""

from __future__ import annotations

import logging
from pathlib import Path

from fanstore.mount.job_memory import CgroupLimit, JobMemory, job_memory, memory_file_system
from fanstore.mount.mount import cache_bound

GIB, MIB = 1 << 30, 1 << 20
V1_NO_LIMIT = 9223372036854771712  # what cgroup v1 writes for none
V1_MOUNTS = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V2_MOUNTS = "31 23 0:28 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def fake_system(root: Path, mountinfo: str, cgroup: str, files: dict[str, str], available: int = 20 * GIB) -> Path:
    """/proc/meminfo, /proc/self/{cgroup,mountinfo} and the cgroup files `files` (paths under `root`)."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/meminfo").write_text(f"MemTotal:       32000000 kB\nMemAvailable:   {available // 1024} kB\n")
    (root / "proc/self/cgroup").write_text(cgroup)
    (root / "proc/self/mountinfo").write_text(mountinfo)
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text + "\n")
    return root


def v1_level(directory: str, limit: int, usage: int, inactive_file: int = 0) -> dict[str, str]:
    return {f"{directory}/memory.limit_in_bytes": str(limit), f"{directory}/memory.usage_in_bytes": str(usage),
            f"{directory}/memory.stat": f"cache 0\ninactive_file 0\ntotal_inactive_file {inactive_file}\n"}


def v2_level(directory: str, limit: str, current: int, inactive_file: int = 0) -> dict[str, str]:
    return {f"{directory}/memory.max": limit, f"{directory}/memory.current": str(current),
            f"{directory}/memory.stat": f"anon 1\nfile 2\ninactive_file {inactive_file}\nshmem 3\n"}


ROOT_V1 = v1_level("sys/fs/cgroup/memory", V1_NO_LIMIT, 3 * GIB)


def test_without_a_memory_cgroup_limit_the_machines_available_memory_is_the_answer(tmp_path):
    job = "4:memory:/user.slice\n0::/user.slice\n"
    root = fake_system(tmp_path, V1_MOUNTS, job, {**ROOT_V1, **v1_level("sys/fs/cgroup/memory/user.slice",
                                                                           V1_NO_LIMIT, GIB)}, available=12 * GIB)
    memory = job_memory(root)
    assert memory == JobMemory(12 * GIB, None)
    assert memory.available == 12 * GIB
    assert memory.describe() == "the machine's available memory, 12.9 GB (MemAvailable)"


def test_a_v1_job_limit_below_the_machines_memory_bounds_it_and_page_cache_counts_as_room(tmp_path):
    """SLURM's cgroup v1 layout: the limit on the job, the process in a task's cgroup below it. Usage there counts
    the page cache; what is inactive the kernel drops before it kills, so it is room."""
    job = "/slurm/uid_1000/job_42"
    task = f"{job}/step_0/task_0"
    files = {**ROOT_V1,
             **v1_level(f"sys/fs/cgroup/memory{job}", 4 * GIB, 1536 * MIB, inactive_file=512 * MIB),
             **v1_level(f"sys/fs/cgroup/memory{job}/step_0", V1_NO_LIMIT, 1024 * MIB),
             **v1_level(f"sys/fs/cgroup/memory{task}", V1_NO_LIMIT, 1024 * MIB)}
    root = fake_system(tmp_path, V1_MOUNTS, f"11:pids:{task}\n4:memory:{task}\n1:name=systemd:{task}\n0::/\n", files)
    memory = job_memory(root)
    assert memory.cgroup == CgroupLimit(job, 1, 4 * GIB, 1024 * MIB)
    assert memory.available == 3 * GIB
    assert memory.describe() == ("the 3.22 GB left in this job's memory cgroup /slurm/uid_1000/job_42 (limit 4.29 GB, "
                                 "1.07 GB in use)")


def test_the_cgroup_that_leaves_least_room_binds_not_the_nearest(tmp_path):
    """A step's own limit leaves more room than the job's, whose other steps use most of it."""
    files = {**ROOT_V1,
             **v1_level("sys/fs/cgroup/memory/job", 8 * GIB, 7 * GIB),
             **v1_level("sys/fs/cgroup/memory/job/step", 6 * GIB, 2 * GIB)}
    root = fake_system(tmp_path, V1_MOUNTS, "4:memory:/job/step\n", files)
    assert job_memory(root).cgroup == CgroupLimit("/job", 1, 8 * GIB, 7 * GIB)
    assert job_memory(root).available == GIB


def test_v1_without_hierarchy_a_parents_limit_does_not_count(tmp_path):
    files = {**ROOT_V1, **v1_level("sys/fs/cgroup/memory/parent", GIB, 900 * MIB),
             "sys/fs/cgroup/memory/parent/memory.use_hierarchy": "0",
             **v1_level("sys/fs/cgroup/memory/parent/job", 4 * GIB, 100 * MIB)}
    root = fake_system(tmp_path, V1_MOUNTS, "4:memory:/parent/job\n", files)
    assert job_memory(root).cgroup == CgroupLimit("/parent/job", 1, 4 * GIB, 100 * MIB)


def test_a_limit_above_what_the_machine_has_leaves_the_machine_as_the_bound_and_says_so(tmp_path):
    files = {**ROOT_V1, **v1_level("sys/fs/cgroup/memory/job", 64 * GIB, GIB)}
    root = fake_system(tmp_path, V1_MOUNTS, "4:memory:/job\n", files, available=10 * GIB)
    memory = job_memory(root)
    assert memory.available == 10 * GIB and not memory.bound_by_cgroup
    assert memory.describe() == ("the machine's available memory, 10.7 GB (MemAvailable); this job's memory cgroup "
                                 "/job (limit 68.7 GB, 1.07 GB in use) leaves more")


def test_cgroup_v2_memory_max_and_current_with_max_meaning_none(tmp_path):
    files = {**v2_level("sys/fs/cgroup/system.slice/slurmstepd.scope/job_7", "2147483648", 600 * MIB,
                        inactive_file=88 * MIB),
             **v2_level("sys/fs/cgroup/system.slice/slurmstepd.scope/job_7/step_0/user/task_0", "max", 400 * MIB),
             **v2_level("sys/fs/cgroup/system.slice/slurmstepd.scope/job_7/step_0/user", "max", 400 * MIB),
             **v2_level("sys/fs/cgroup/system.slice/slurmstepd.scope/job_7/step_0", "max", 400 * MIB),
             **v2_level("sys/fs/cgroup/system.slice/slurmstepd.scope", "max", 600 * MIB),
             **v2_level("sys/fs/cgroup/system.slice", "max", 2 * GIB)}
    task = "/system.slice/slurmstepd.scope/job_7/step_0/user/task_0"
    root = fake_system(tmp_path, V2_MOUNTS, f"0::{task}\n", files)
    memory = job_memory(root)
    assert memory.cgroup == CgroupLimit("/system.slice/slurmstepd.scope/job_7", 2, 2 * GIB, 512 * MIB)
    assert memory.available == 1536 * MIB


def test_a_v2_cgroup_without_the_memory_controller_sets_no_limit(tmp_path):
    root = fake_system(tmp_path, V2_MOUNTS, "0::/job\n", {"sys/fs/cgroup/job/cgroup.procs": "1"})
    assert job_memory(root).cgroup is None


def test_a_containers_cgroup_mount_that_starts_at_its_own_cgroup(tmp_path):
    """Docker without a cgroup namespace: /proc/self/cgroup names the container's cgroup, and the memory hierarchy
    mounted in the container starts there (mountinfo's root field)."""
    mounts = "35 31 0:32 /docker/abc123 /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n"
    files = v1_level("sys/fs/cgroup/memory", 3 * GIB, GIB)
    root = fake_system(tmp_path, mounts, "9:memory:/docker/abc123\n", files)
    assert job_memory(root).cgroup == CgroupLimit("/docker/abc123", 1, 3 * GIB, GIB)


def test_what_cannot_be_read_counts_as_no_limit(tmp_path):
    """No cgroup file system, a cgroup outside the one mounted, files missing or garbled: the machine bounds it."""
    garbled = {**ROOT_V1, "sys/fs/cgroup/memory/job/memory.limit_in_bytes": "lots",
               "sys/fs/cgroup/memory/job/memory.usage_in_bytes": "1"}
    outside = "35 31 0:32 /docker/abc /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n"
    for name, mounts, cgroup, files in [("no mount", "", "4:memory:/job\n", {}),
                                         ("outside", outside, "4:memory:/other\n", {}),
                                         ("missing", V1_MOUNTS, "4:memory:/job\n", {}),
                                         ("garbled", V1_MOUNTS, "4:memory:/job\n", garbled),
                                         ("no cgroup file", V1_MOUNTS, "", {})]:
        root = fake_system(tmp_path / name.replace(" ", "_"), mounts, cgroup, files)
        if name == "no cgroup file":
            (root / "proc/self/cgroup").unlink()
        assert job_memory(root) == JobMemory(20 * GIB, None), name


def test_memory_file_systems_are_found_by_the_innermost_mount(tmp_path):
    mounts = ("22 1 8:1 / / rw - ext4 /dev/vda rw\n"
              "23 22 0:20 / /dev/shm rw - tmpfs tmpfs rw\n"
              "24 23 0:21 / /dev/shm/on\\040disk rw - ext4 /dev/vdb rw\n"
              "25 22 0:22 / /local rw - ramfs ramfs rw\n")
    root = fake_system(tmp_path, mounts, "", {})
    assert memory_file_system(Path("/dev/shm/job/local0"), root) == "tmpfs"
    assert memory_file_system(Path("/dev/shm"), root) == "tmpfs"
    assert memory_file_system(Path("/dev/shm/on disk/local0"), root) is None
    assert memory_file_system(Path("/dev/shmem"), root) is None
    assert memory_file_system(Path("/local/x"), root) == "ramfs"


def test_the_cache_default_is_a_quarter_of_what_the_job_may_use_and_says_which(caplog):
    limited = JobMemory(20 * GIB, CgroupLimit("/slurm/job_42", 1, int(4.8 * GIB), 0))
    bound = cache_bound(None, limited)
    assert bound.size == int(1.2 * GIB)
    assert bound.describe() == ("cache 1.29 GB: a quarter of the 5.15 GB left in this job's memory cgroup "
                                "/slurm/job_42 (limit 5.15 GB, 0 B in use)")
    shared = cache_bound(None, limited, shared_by=3)
    assert shared.size == int(1.2 * GIB / 3)
    assert shared.why.endswith(", split among the 3 ranks on this host that draw on it")
    assert cache_bound(None, JobMemory(8 * GIB, None)).describe() == \
        "cache 2.15 GB: a quarter of the machine's available memory, 8.59 GB (MemAvailable)"
    with caplog.at_level(logging.WARNING, logger="fanstore.mount"):
        assert cache_bound(GIB, limited).size == GIB
        assert caplog.text == ""
        assert cache_bound(2 * GIB, limited, shared_by=3).describe() == "cache 2.15 GB: --cache-size 2GiB"
    assert "--cache-size 2GiB on each of 3 ranks is more than the 5.15 GB left in this job's memory cgroup" \
        in caplog.text
