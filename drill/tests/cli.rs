//! Flags a drill can never succeed with are refused by the binary before it starts
//! anything (no cluster, no loop device, no temp dir), with clap's usage exit code.

use std::process::Command;

/// (exit code, stderr, stdout).
fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fencecsi-drill"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn impossible_flags_are_refused_before_anything_starts() {
    for (args, says) in [
        (&["--volumes", "0"][..], "--volumes"),
        (&["--nodes", "1"][..], "--nodes"),
        (&["--fs", "btrfs"][..], "--fs"),
        (&["--monitor-grace", "0"][..], "--monitor-grace"),
        (&["--step-timeout", "0"][..], "--step-timeout"),
        (&["--step-timeout", "2"][..], "not longer than"),
        (&["--step-timeout", "1"][..], "not longer than"),
        (&["--production", "--podgc-grace", "5"][..], "--production"),
    ] {
        let (code, err, out) = run(args);
        assert_eq!(code, 2, "{args:?} was not refused: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
        // Refused by argument parsing (clap's "error: ..."), not by a drill that started
        // and failed: nothing of a run (its progress goes to stdout).
        assert!(err.contains("error:"), "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?} started: {out}");
    }
    // Control: the same binary accepts its flags (--help parses and exits 0).
    let (code, _, out) = run(&["--help"]);
    assert_eq!(code, 0, "{out}");
}
