//! Test machinery stays out of the production binaries. Failpoints are for
//! tests only (the driver's `failpoints` feature, off by default): the
//! production binary must not have them, so that no environment variable can
//! abort the daemon or fake a failed fence probe. Nor may the daemons carry the
//! embedded cluster or the controller simulations (crate
//! fencecsi-embedded-cluster). Checked on built binaries' symbols and on how the image
//! build resolves features.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use fencecsi_driver::failpoint;
use fencecsi_tests::rig::fresh_driver_binary;

const WORKSPACE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// The failpoint names in the driver's and the fence crate's sources: the first argument of every
/// `failpoint::{hit, stall, pause, is_armed}` call, a string literal or a
/// `const` of the same file.
fn failpoint_names() -> Vec<String> {
    fn walk(dir: &Path, names: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).expect("reading a source directory") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                walk(&path, names);
                continue;
            }
            let src = std::fs::read_to_string(&path).expect("reading a source file");
            for call in ["hit(", "stall(", "pause(", "is_armed("] {
                for (at, _) in src.match_indices(&format!("failpoint::{call}")) {
                    let arg = src[at + "failpoint::".len() + call.len()..].trim_start();
                    let name = if let Some(literal) = arg.strip_prefix('"') {
                        literal[..literal.find('"').expect("closing quote")].to_string()
                    } else {
                        let ident: String = arg
                            .chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect();
                        let def = format!("const {ident}: &str = \"");
                        let value = &src[src.find(&def).unwrap_or_else(|| {
                            panic!("{}: no `{def}` for a failpoint", path.display())
                        }) + def.len()..];
                        value[..value.find('"').expect("closing quote")].to_string()
                    };
                    if !names.contains(&name) {
                        names.push(name);
                    }
                }
            }
        }
    }
    let mut names = Vec::new();
    for dir in ["driver/src", "fence/src"] {
        walk(&Path::new(WORKSPACE).join(dir), &mut names);
    }
    names
}

/// The needles that occur in `haystack`, in one pass.
fn occurring<'a>(haystack: &[u8], needles: &[&'a str]) -> Vec<&'a str> {
    let mut first = [false; 256];
    for n in needles {
        first[n.as_bytes()[0] as usize] = true;
    }
    let mut found = Vec::new();
    for i in 0..haystack.len() {
        if first[haystack[i] as usize] {
            for n in needles {
                if haystack[i..].starts_with(n.as_bytes()) && !found.contains(n) {
                    found.push(*n);
                }
            }
        }
    }
    found
}

/// The names in the symbol tables (.symtab, .dynsym) of a 64-bit
/// little-endian ELF file.
fn elf_symbols(elf: &[u8]) -> Vec<String> {
    assert!(
        elf.starts_with(b"\x7fELF") && elf[4] == 2 && elf[5] == 1,
        "not a 64-bit little-endian ELF file"
    );
    let u16_at = |o: usize| u16::from_le_bytes(elf[o..o + 2].try_into().unwrap()) as usize;
    let u32_at = |o: usize| u32::from_le_bytes(elf[o..o + 4].try_into().unwrap()) as usize;
    let u64_at = |o: usize| u64::from_le_bytes(elf[o..o + 8].try_into().unwrap()) as usize;
    let (shoff, shentsize, shnum) = (u64_at(0x28), u16_at(0x3a), u16_at(0x3c));
    // (sh_type, sh_offset, sh_size, sh_link) of section `i`.
    let section = |i: usize| {
        let h = shoff + i * shentsize;
        (
            u32_at(h + 4),
            u64_at(h + 0x18),
            u64_at(h + 0x20),
            u32_at(h + 0x28),
        )
    };
    let mut names = Vec::new();
    for i in 0..shnum {
        let (kind, offset, size, link) = section(i);
        if kind != 2 && kind != 11 {
            continue; // neither SHT_SYMTAB nor SHT_DYNSYM
        }
        let strings = section(link).1;
        for sym in (offset..offset + size).step_by(24) {
            let name = &elf[strings + u32_at(sym)..];
            let end = name
                .iter()
                .position(|&b| b == 0)
                .expect("NUL-terminated name");
            names.push(String::from_utf8_lossy(&name[..end]).into_owned());
        }
    }
    names
}

/// The three daemons, as the image builds them.
const DAEMONS: [&str; 3] = ["fencecsi-driver", "fencecsi-attacher", "fencecsi-podgc"];

/// Builds the daemons as deploy/Dockerfile does (one `cargo build -p .. -p ..`;
/// the image adds --release) and returns the target dir they are in. A target
/// dir of its own on purpose: in the shared one the build would replace
/// target/debug/fencecsi-driver, which other tests (and other test processes)
/// run. The first run builds their dependencies there once.
fn build_daemons() -> std::path::PathBuf {
    let target = Path::new(WORKSPACE).join("target/no-failpoints");
    let mut cmd = Command::new(env!("CARGO"));
    cmd.arg("build");
    for b in DAEMONS {
        cmd.args(["-p", b, "--bin", b]);
    }
    let out = cmd
        .arg("--target-dir")
        .arg(&target)
        .current_dir(WORKSPACE)
        .output()
        .expect("running cargo build");
    assert!(
        out.status.success(),
        "building the daemons failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    target
}

#[test]
fn the_production_driver_binary_has_no_failpoints() {
    let names = failpoint_names();
    assert!(
        names.len() >= 20
            && [
                "stage:after-attach",
                "quiesce:copying",
                "gc:before-stray-fence",
                "fence-probe:fail"
            ]
            .iter()
            .all(|n| names.iter().any(|m| m == n)),
        "the scan of driver/src and fence/src found too few failpoints: {names:?}"
    );
    let mut needles: Vec<&str> = names.iter().map(String::as_str).collect();
    needles.extend([failpoint::ENV, failpoint::STALLED_THREAD]);

    // Positive control: the binary the crash tests run has every one of them
    // and failpoint symbols, so the checks below can see them.
    let featured = std::fs::read(fresh_driver_binary()).expect("reading the driver binary");
    let found = occurring(&featured, &needles);
    let missing: Vec<_> = needles.iter().filter(|n| !found.contains(n)).collect();
    assert!(
        missing.is_empty(),
        "the binary with failpoints lacks {missing:?}"
    );
    assert!(
        elf_symbols(&featured)
            .iter()
            .any(|s| s.contains("failpoint")),
        "the binary with failpoints has no failpoint symbols"
    );

    let started = Instant::now();
    let target = build_daemons();
    eprintln!(
        "the daemons without failpoints built in {:.1?}",
        started.elapsed()
    );
    let plain = std::fs::read(target.join("debug/fencecsi-driver")).expect("reading the binary");
    let found = occurring(&plain, &needles);
    assert!(
        found.is_empty(),
        "the driver built without the `failpoints` feature contains {found:?}"
    );
    let symbols = elf_symbols(&plain);
    assert!(!symbols.is_empty(), "the binary has no symbol table");
    let failpoint_symbols: Vec<_> = symbols.iter().filter(|s| s.contains("failpoint")).collect();
    assert!(
        failpoint_symbols.is_empty(),
        "the driver built without the `failpoints` feature has failpoint symbols: {failpoint_symbols:?}"
    );
}

/// The features cargo gives `package` when it resolves `args` (a `cargo
/// tree` package selection): the `{f}` of its line.
fn features_of(package: &str, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO"))
        .arg("tree")
        .args(args)
        .args(["-f", "{p} [{f}]", "--prefix", "none"])
        .current_dir(WORKSPACE)
        .output()
        .expect("running cargo tree");
    assert!(
        out.status.success(),
        "cargo tree {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8(out.stdout).expect("UTF-8 from cargo tree");
    let line = tree
        .lines()
        .find(|l| l.starts_with(&format!("{package} ")))
        .unwrap_or_else(|| panic!("cargo tree {args:?} does not list {package}:\n{tree}"));
    line[line.rfind('[').expect("features")..].to_string()
}

/// The image (deploy/Dockerfile) builds its binaries with one `cargo build -p
/// .. -p ..`: cargo unifies features over those packages and their normal
/// dependencies, so none of them may turn `failpoints` (driver, fence,
/// failpoint crates) or the fence's `test-support` on, and the command must
/// not ask for features.
#[test]
fn the_image_build_leaves_failpoints_off() {
    let dockerfile = std::fs::read_to_string(Path::new(WORKSPACE).join("deploy/Dockerfile"))
        .expect("reading deploy/Dockerfile");
    let at = dockerfile
        .find("cargo build")
        .expect("deploy/Dockerfile runs cargo build");
    let command = &dockerfile[at..];
    let command = &command[..command.find("&&").unwrap_or(command.len())];
    let words: Vec<&str> = command.split_whitespace().filter(|w| *w != "\\").collect();
    assert!(
        !words
            .iter()
            .any(|w| w.starts_with("--features") || w.starts_with("-F") || *w == "--all-features"),
        "deploy/Dockerfile builds with features: {command}"
    );
    let mut selection: Vec<&str> = Vec::new();
    for pair in words.windows(2).filter(|p| p[0] == "-p") {
        selection.extend(["-p", pair[1]]);
    }
    assert!(
        selection.contains(&"fencecsi-driver"),
        "deploy/Dockerfile does not build fencecsi-driver: {command}"
    );

    // Positive controls: the tests' build turns failpoints on in every crate
    // that has them, and the driver's own tests the fence's test helpers.
    for package in ["fencecsi-driver", "fencecsi-fence", "fencecsi-failpoint"] {
        let tests = features_of(package, &["-p", "fencecsi-tests"]);
        assert!(
            tests.contains("failpoints"),
            "fencecsi-tests: {package} {tests}"
        );
    }
    let driver_tests = features_of("fencecsi-fence", &["-p", "fencecsi-driver"]);
    assert!(
        driver_tests.contains("test-support"),
        "the driver's tests: fencecsi-fence {driver_tests}"
    );

    selection.extend(["-e", "no-dev"]);
    for package in ["fencecsi-driver", "fencecsi-fence", "fencecsi-failpoint"] {
        let image = features_of(package, &selection);
        assert!(
            !image.contains("failpoints") && !image.contains("test-support"),
            "`cargo build {}` turns test features on: {package} {image}",
            selection.join(" ")
        );
    }
}

/// The names of symbols from the embedded cluster and the controller simulations
/// (crate fencecsi-embedded-cluster), in either symbol mangling (both length-prefix the
/// crate's name).
fn simulator_symbols(symbols: &[String]) -> Vec<&String> {
    symbols
        .iter()
        .filter(|s| s.contains("25fencecsi_embedded_cluster"))
        .collect()
}

/// The three daemons as the image builds them (one `cargo build -p .. -p ..`,
/// deploy/Dockerfile, without --release) carry neither the embedded cluster nor
/// the simulations: checked on their symbol tables.
#[test]
fn the_production_binaries_carry_no_simulator() {
    // Positive control: this test binary links the embedded cluster (the reference
    // below keeps it), and the check finds it.
    std::hint::black_box(
        fencecsi_embedded_cluster::EmbeddedCluster::new
            as fn() -> fencecsi_embedded_cluster::EmbeddedCluster,
    );
    let me = std::fs::read(std::env::current_exe().unwrap()).expect("reading the test binary");
    assert!(
        !simulator_symbols(&elf_symbols(&me)).is_empty(),
        "the check finds no embedded-cluster symbol even where it is linked"
    );

    let target = build_daemons();
    for b in DAEMONS {
        let elf = std::fs::read(target.join("debug").join(b)).expect("reading the binary");
        let symbols = elf_symbols(&elf);
        assert!(!symbols.is_empty(), "{b} has no symbol table");
        let found = simulator_symbols(&symbols);
        assert!(
            found.is_empty(),
            "{b} carries the embedded cluster or a simulation: {:?}",
            &found[..found.len().min(5)]
        );
    }
}
