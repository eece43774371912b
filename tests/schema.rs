//! Old logs must replay forever: every event's encoding at every schema version is kept in
//! `schema/fixtures/v{N}/`, and each must still decode to the event it was written from.
//! `EBB_BLESS=1 cargo test --test integration schema::` writes the fixtures of the current
//! version; fixtures of older versions are never rewritten.

use std::collections::BTreeSet;
use std::path::PathBuf;

use ebb::event::{Envelope, SCHEMA_VERSION, decode, encode, examples};

const AT_MS: u64 = 1_767_225_600_000;

fn dir(version: u16) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("schema/fixtures/v{version}"))
}

#[test]
fn every_event_has_one_example() {
    let names: Vec<&str> = examples().iter().map(|e| e.name()).collect();
    let unique: BTreeSet<&str> = names.iter().copied().collect();
    assert_eq!(
        names.len(),
        unique.len(),
        "an event appears twice in examples()"
    );
    assert_eq!(
        names.len(),
        32,
        "a new event needs an example and a fixture"
    );
    let doc =
        std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("schema/events.md"))
            .unwrap();
    for n in &names {
        assert!(
            doc.contains(&format!("### {n}")),
            "schema/events.md lacks {n}"
        );
    }
}

#[test]
fn fixtures_of_every_version_still_decode() {
    let bless = std::env::var_os("EBB_BLESS").is_some();
    for (i, event) in examples().into_iter().enumerate() {
        let env = Envelope {
            seq: i as u64 + 1,
            at_ms: AT_MS,
            version: SCHEMA_VERSION,
            event,
        };
        let path = dir(SCHEMA_VERSION).join(format!("{}.msgpack", env.event.name()));
        if bless {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, encode(&env)).unwrap();
        }
        let bytes = std::fs::read(&path).unwrap_or_else(|e| {
            panic!("{}: {e} (run with EBB_BLESS=1 to write it)", path.display())
        });
        assert_eq!(decode(&bytes).unwrap(), env, "{}", path.display());
        assert_eq!(
            encode(&env),
            bytes,
            "the encoding of {} changed",
            env.event.name()
        );
    }
    // Every version's fixtures, older ones included, must decode (to today's shape of the event),
    // and no version may be missing.
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("schema/fixtures");
    let mut versions = BTreeSet::new();
    for entry in std::fs::read_dir(&root).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().into_string().unwrap();
        let version: u16 = name
            .strip_prefix('v')
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("unexpected fixture dir {name}"));
        versions.insert(version);
        for file in std::fs::read_dir(entry.path()).unwrap() {
            let path = file.unwrap().path();
            let bytes = std::fs::read(&path).unwrap();
            let env = decode(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert_eq!(env.version, version, "{}", path.display());
        }
    }
    assert_eq!(versions, (1..=SCHEMA_VERSION).collect::<BTreeSet<_>>());
}
