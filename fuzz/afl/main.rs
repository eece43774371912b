//! ebb's fuzz targets under AFL++: one binary, the target named by `EBB_FUZZ_TARGET` (a name of
//! `ebb_fuzz_checks::TARGETS`, as the files of `fuzz/fuzz_targets/` are named).

fn main() {
    let name = std::env::var("EBB_FUZZ_TARGET").unwrap_or_default();
    let Some(&(_, check)) = ebb_fuzz_checks::TARGETS.iter().find(|(n, _)| *n == name) else {
        let names: Vec<&str> = ebb_fuzz_checks::TARGETS.iter().map(|(n, _)| *n).collect();
        eprintln!("EBB_FUZZ_TARGET {name:?} is none of {names:?}");
        std::process::exit(2);
    };
    afl::fuzz!(|data: &[u8]| check(data));
}
