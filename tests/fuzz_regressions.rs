//! The fuzz targets' checks on stable, over their seed corpus (`fuzz/corpus/TARGET/`) and every
//! input a fuzzer once found failing (`fuzz/regressions/TARGET/`): a crash found once stays
//! fixed. `scripts/fuzz` runs the targets themselves under libFuzzer.

use std::path::Path;

fn inputs(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<(String, Vec<u8>)> = entries
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.is_file())
        .map(|p| {
            let bytes = std::fs::read(&p).expect("an input");
            (p.display().to_string(), bytes)
        })
        .collect();
    out.sort();
    out
}

#[test]
fn every_target_has_its_program_and_seeds() {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let manifest = std::fs::read_to_string(fuzz.join("Cargo.toml")).unwrap();
    for (name, _) in ebb_fuzz_checks::TARGETS {
        let program = fuzz.join("fuzz_targets").join(format!("{name}.rs"));
        let text = std::fs::read_to_string(&program)
            .unwrap_or_else(|e| panic!("{}: {e}", program.display()));
        assert!(
            text.contains(&format!("ebb_fuzz_checks::{name}(data)")),
            "{} runs ebb_fuzz_checks::{name}",
            program.display()
        );
        assert!(
            manifest.contains(&format!("name = \"{name}\"")),
            "fuzz/Cargo.toml declares {name}"
        );
        assert!(
            !inputs(&fuzz.join("corpus").join(name)).is_empty(),
            "fuzz/corpus/{name} has seeds"
        );
    }
    let programs = std::fs::read_dir(fuzz.join("fuzz_targets"))
        .unwrap()
        .count();
    assert_eq!(
        programs,
        ebb_fuzz_checks::TARGETS.len(),
        "every program is a target"
    );
}

#[test]
fn seeds_and_found_inputs_pass() {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut ran = 0;
    for (name, check) in ebb_fuzz_checks::TARGETS {
        for dir in ["corpus", "regressions"] {
            for (path, bytes) in inputs(&fuzz.join(dir).join(name)) {
                let outcome = std::panic::catch_unwind(|| check(&bytes));
                assert!(outcome.is_ok(), "{name} fails on {path}");
                ran += 1;
            }
        }
    }
    assert!(ran >= ebb_fuzz_checks::TARGETS.len());
}
