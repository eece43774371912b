//! `ebb_fuzz_checks::cel`: what it feeds and what must hold are said there.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ebb_fuzz_checks::cel(data));
