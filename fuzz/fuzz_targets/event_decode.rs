//! Any bytes given to the log's decoder give an envelope or an error, never a panic; what decodes
//! re-encodes to something that decodes to the same envelope.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(env) = ebb::event::decode(data) {
        let again = ebb::event::decode(&ebb::event::encode(&env)).expect("re-encoded envelope decodes");
        assert_eq!(again, env);
    }
});
