//! ebb's container image (`scripts/image`), run for real: loaded from its OCI archive into podman
//! and run with runc, in a network namespace the test makes, as its non-root user on a read-only
//! root filesystem, its data on a mounted volume. It serves, wakes the example app inside the
//! container, keeps every acknowledged write across a SIGKILL and a new container, and stops by
//! itself on SIGTERM. `EBB_IMAGE` names the archive (`scripts/test` builds it, twice: the two
//! builds must have the same digest).

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::controlplane::{private_network, wait_until};
use common::http::{client, send, send_json};
use serde_json::json;

const LIMIT: Duration = Duration::from_secs(60);
/// The image's user.
const UID: u32 = 65532;

fn podman(args: &[&str]) -> String {
    let out = Command::new("podman")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("podman {args:?}: {e} (apt-get install podman runc)"));
    assert!(
        out.status.success(),
        "podman {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Removes the test's containers, then its image, however it ends (the store keeps no image
/// per run).
struct Containers(Vec<String>, String);

impl Drop for Containers {
    fn drop(&mut self) {
        for c in &self.0 {
            let _ = Command::new("podman")
                .args(["rm", "-f", "-t", "0", c])
                .output();
        }
        let _ = Command::new("podman").args(["rmi", "-f", &self.1]).output();
    }
}

/// Runs the image as container `name` with the data directory `data` and `config` mounted,
/// ebb's proxy and admin API on `proxy_port` and `admin_port` of the namespace's loopback.
fn run(image: &str, name: &str, data: &str, config: &str, ports: (u16, u16)) -> String {
    let listen = format!("--listen=127.0.0.1:{}", ports.0);
    let admin = format!("--admin-listen=127.0.0.1:{}", ports.1);
    podman(&[
        "--runtime",
        "runc",
        "run",
        "--detach",
        "--name",
        name,
        "--network",
        "host",
        "--read-only",
        // podman's default limits are above what this machine allows a process.
        "--ulimit",
        "nofile=1024:1024",
        "--ulimit",
        "nproc=4096:4096",
        "--stop-timeout",
        "30",
        "-v",
        &format!("{data}:/data"),
        "-v",
        &format!("{config}:/etc/ebb/ebb.toml:ro"),
        image,
        "serve",
        &listen,
        &admin,
        "--data-dir=/data",
        "--config=/etc/ebb/ebb.toml",
        "--admin-token=admin",
    ])
}

#[tokio::test]
async fn the_image_serves_wakes_keeps_its_log_on_its_volume_and_stops_on_sigterm() {
    let archive = std::env::var("EBB_IMAGE").expect(
        "EBB_IMAGE names ebb's image archive: `scripts/image` builds it (scripts/test does)",
    );
    private_network();
    let loaded = podman(&["load", "--quiet", "-i", &archive]);
    let image = loaded
        .lines()
        .find_map(|l| l.strip_prefix("Loaded image: "))
        .unwrap_or_else(|| panic!("no image loaded from {archive}: {loaded}"))
        .trim()
        .to_owned();
    let size: u64 = podman(&["image", "inspect", "--format", "{{.Size}}", &image])
        .parse()
        .unwrap();
    println!("image {image}: {:.1} MB", size as f64 / 1e6);
    let user = podman(&["image", "inspect", "--format", "{{.Config.User}}", &image]);
    assert_eq!(
        user,
        format!("{UID}:{UID}"),
        "the image runs as ebb, not root"
    );
    // The Containerfile (for builds elsewhere) says what scripts/image does.
    let inspect: serde_json::Value =
        serde_json::from_str(&podman(&["image", "inspect", &image])).unwrap();
    let config = &inspect[0]["Config"];
    let file =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Containerfile")).unwrap();
    // The final stage's: the last of each.
    let line = |word: &str| {
        file.lines()
            .filter_map(|l| l.strip_prefix(word))
            .next_back()
            .unwrap_or_else(|| panic!("no {word} in the Containerfile"))
            .trim()
            .to_owned()
    };
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&line("CMD ")).unwrap(),
        config["Cmd"]
    );
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&line("ENTRYPOINT ")).unwrap(),
        config["Entrypoint"]
    );
    assert_eq!(line("USER "), user);
    assert_eq!(line("WORKDIR "), config["WorkingDir"].as_str().unwrap());
    let labels = config["Labels"].as_object().unwrap();
    let ours = labels
        .keys()
        .filter(|l| l.starts_with("org.opencontainers."));
    assert_eq!(ours.clone().count(), 6, "{labels:?}");
    for label in ours {
        assert!(
            file.contains(&format!("{label}=")),
            "{label} not in the Containerfile"
        );
    }

    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    std::os::unix::fs::chown(&data, Some(UID), Some(UID)).unwrap();
    let config = dir.path().join("ebb.toml");
    std::fs::write(
        &config,
        "[[app]]\nname = \"demo\"\ndomains = [\"demo.localhost\"]\n\
         command = [\"ebb\", \"example-app\"]\nreadiness_path = \"/health\"\nidle_after_ms = 60000\n",
    )
    .unwrap();
    let (data, config) = (data.to_str().unwrap(), config.to_str().unwrap());
    let ports = (common::free_port(), common::free_port());
    let proxy = std::net::SocketAddr::from(([127, 0, 0, 1], ports.0));
    let admin = std::net::SocketAddr::from(([127, 0, 0, 1], ports.1));
    let name = format!("ebb-image-test-{}", std::process::id());
    let mut containers = Containers(vec![name.clone()], image.clone());
    run(&image, &name, data, config, ports);
    let c = client();
    wait_until("ebb in the container answering /healthz", LIMIT, || async {
        tokio::net::TcpStream::connect(admin).await.ok()?;
        let a = send(&c, admin, "GET", "localhost", "/healthz", &[]).await;
        (a.status == 200).then_some(())
    })
    .await;

    // The first request wakes the example app inside the container.
    let a = send(&c, proxy, "GET", "demo.localhost", "/pid", &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let pid = a.body.trim().to_owned();
    assert!(pid.parse::<u32>().is_ok(), "{pid}");

    // Acknowledged writes, then SIGKILL: a new container on the same volume has them all.
    let auth = [("authorization", "Bearer admin")];
    for i in 0..20 {
        let route = json!({
            "domains": [format!("r{i}.localhost")],
            "command": ["ebb", "example-app"],
        });
        let r = send_json(
            &c,
            admin,
            "PUT",
            &format!("/admin/routes/r{i}"),
            &auth,
            &route,
        )
        .await;
        assert!(r.status < 300, "{} {}", r.status, r.body);
    }
    podman(&["kill", "--signal", "KILL", &name]);
    podman(&["wait", &name]);
    podman(&["rm", &name]);
    let again = format!("{name}-again");
    containers.0.push(again.clone());
    run(&image, &again, data, config, ports);
    let routes = wait_until("the new container serving", LIMIT, || async {
        tokio::net::TcpStream::connect(admin).await.ok()?;
        let a = send(&c, admin, "GET", "localhost", "/admin/routes", &auth).await;
        (a.status == 200).then_some(a.body)
    })
    .await;
    for i in 0..20 {
        assert!(
            routes.contains(&format!("\"r{i}\"")),
            "route r{i} lost across the SIGKILL: {routes}"
        );
    }
    let a = send(&c, proxy, "GET", "demo.localhost", "/pid", &[]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    // What the container wrote is the image's user's, on the volume.
    let owner = std::fs::metadata(format!("{data}/CURRENT")).unwrap();
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&owner), UID);

    // SIGTERM: ebb stops by itself (exit 0), not by podman's SIGKILL after --stop-timeout.
    podman(&["stop", &again]);
    let code = podman(&["inspect", "--format", "{{.State.ExitCode}}", &again]);
    assert_eq!(code, "0", "ebb did not stop cleanly on SIGTERM");
}

/// The image's bill of materials (CycloneDX, beside the archive) names the image by its digest,
/// every crate compiled into `ebb` at its Cargo.lock version, and the Debian package of every
/// library the image holds and of its CA certificates; it says nothing of the machine that
/// built it.
#[test]
fn the_bill_of_materials_names_every_crate_and_package_of_the_image() {
    let archive = std::env::var("EBB_IMAGE").expect(
        "EBB_IMAGE names ebb's image archive: `scripts/image` builds it (scripts/test does)",
    );
    let path = format!("{}.cdx.json", archive.trim_end_matches(".oci.tar"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    assert!(
        !text.contains("file:///"),
        "a build machine's path in {path}"
    );
    let bom: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(bom["bomFormat"], "CycloneDX");
    assert_eq!(bom["specVersion"], "1.5");

    // The image, by the digest its archive gives.
    let index = Command::new("tar")
        .args(["-xOf", &archive, "index.json"])
        .output()
        .unwrap();
    let index: serde_json::Value = serde_json::from_slice(&index.stdout).unwrap();
    let digest = index["manifests"][0]["digest"].as_str().unwrap();
    let image = &bom["metadata"]["component"];
    assert_eq!(image["type"], "container");
    assert_eq!(image["bom-ref"], format!("image:{digest}"));

    // Crates: each at the version Cargo.lock pins; the ones ebb is made of among them.
    let lock = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.lock")).unwrap();
    let components = bom["components"].as_array().unwrap();
    let purls: Vec<&str> = components
        .iter()
        .filter_map(|c| c["purl"].as_str())
        .collect();
    let mut crates = 0;
    for c in components.iter().filter(|c| {
        c["purl"]
            .as_str()
            .is_some_and(|p| p.starts_with("pkg:cargo/"))
    }) {
        let pinned = format!(
            "name = \"{}\"\nversion = \"{}\"",
            c["name"].as_str().unwrap(),
            c["version"].as_str().unwrap()
        );
        assert!(lock.contains(&pinned), "{} is not in Cargo.lock", c["purl"]);
        crates += 1;
    }
    for name in [
        "ebb-core",
        "ebb-proxy",
        "tokio",
        "hyper",
        "rocksdb",
        "rdkafka",
        "kube-client",
    ] {
        assert!(
            purls
                .iter()
                .any(|p| p.starts_with(&format!("pkg:cargo/{name}@"))),
            "{name} missing"
        );
    }
    assert!(crates > 100, "{crates} crates");

    // Debian packages: the C library, the compiler's runtime libraries, zlib, the certificates.
    for deb in ["libc6", "libgcc-s1", "libstdc++6", "ca-certificates"] {
        assert!(
            purls
                .iter()
                .any(|p| p.starts_with(&format!("pkg:deb/debian/{deb}@"))),
            "{deb} missing from {path}"
        );
    }
}
