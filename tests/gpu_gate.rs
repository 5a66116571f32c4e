//! The GPU-test gate itself: without `FERRY_GPU_TESTS=1` a GPU test skips and says so; with
//! it, a machine without a GPU makes the test fail, never pass. The second half re-runs this
//! binary's own GPU test in a child process with the variable set.

use std::process::Command;

use ferry::testing::{GPU_TESTS_ENV, gpu_test};
use ferry_transports::cuda::{CudaProbe, probe};

/// The GPU test the others re-run in a child: skips without the variable, else needs a GPU.
#[test]
fn gpu_is_visible() {
    let Some(gpu) = gpu_test("gpu_is_visible") else {
        return;
    };
    assert!(!gpu.driver.devices.is_empty());
}

/// Runs `gpu_is_visible` alone in a child of this test binary, with `FERRY_GPU_TESTS` set to
/// `value` (or removed).
fn run_child(value: Option<&str>) -> (bool, String) {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", "gpu_is_visible", "--nocapture"]);
    match value {
        Some(v) => cmd.env(GPU_TESTS_ENV, v),
        None => cmd.env_remove(GPU_TESTS_ENV),
    };
    let out = cmd.output().expect("the test binary runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn without_the_variable_a_gpu_test_skips_and_says_so() {
    for value in [None, Some("0"), Some("")] {
        let (passed, text) = run_child(value);
        assert!(passed, "{value:?}: {text}");
        assert!(
            text.contains(
                "skipped: gpu_is_visible needs a GPU; set FERRY_GPU_TESTS=1 on a GPU machine"
            ),
            "{value:?}: {text}"
        );
    }
}

#[test]
fn with_the_variable_a_machine_without_a_gpu_fails_the_test() {
    let has_gpu = matches!(probe(), CudaProbe::Ready(d) if !d.devices.is_empty());
    let (passed, text) = run_child(Some("1"));
    assert!(!text.contains("skipped:"), "{text}");
    if has_gpu {
        assert!(passed, "a GPU is present, the GPU test must pass: {text}");
    } else {
        assert!(!passed, "no GPU here, the GPU test must fail: {text}");
        assert!(
            text.contains("gpu_is_visible: FERRY_GPU_TESTS=1 but"),
            "the failure says why: {text}"
        );
    }
}
