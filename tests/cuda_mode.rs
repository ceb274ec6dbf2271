//! CUDA mode end to end: `ffi-tests/cuda.c` (device buffers, the caller's streams) against the
//! stand-in driver of `tests/cuda-stub`, on 1-4 ranks as processes and as ranks of one
//! process, every rank on the one stub device (ranks sharing a GPU, as nccl-rs allows).
//! `scripts/device-check.sh` runs the same program against a real GPU.

mod common;

use common::{cuda_stub_dir, Job};

/// Against the stub; with `NCCL_TEST_REAL_DRIVER=1` (scripts/device-check.sh on a GPU
/// machine), against the machine's own driver.
fn cuda_job() -> Job {
    let job = Job::new("cuda").timeout_s(180);
    if std::env::var_os("NCCL_TEST_REAL_DRIVER").is_some() {
        job
    } else {
        job.lib_path(cuda_stub_dir())
    }
}

#[test]
fn cuda_mode_1_rank() {
    cuda_job().run();
}

#[test]
fn cuda_mode_2_processes() {
    cuda_job().procs(2).run();
}

#[test]
fn cuda_mode_4_processes() {
    cuda_job().procs(4).arg("--quick").run();
}

#[test]
fn cuda_mode_2_ranks_in_one_process() {
    cuda_job().local(2).run();
}

#[test]
fn cuda_mode_2_processes_of_2_ranks() {
    cuda_job().procs(2).local(2).arg("--quick").run();
}
