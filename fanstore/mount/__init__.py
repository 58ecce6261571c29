"""The FUSE mount: `mount` (the daemon's lifecycle), `fuse_ops` (kernel requests translated to the core), prefetch,
the kernel's page-cache holds, the daemon's tuning and the job's memory. The package imports none of its modules."""
