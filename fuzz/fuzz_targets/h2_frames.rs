//! `ebb_fuzz_checks::h2_frames`: what it feeds and what must hold are said there.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ebb_fuzz_checks::h2_frames(data));
