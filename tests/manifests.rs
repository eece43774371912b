//! The three forms of ebb's install agree: the Helm chart (`deploy/chart/`), the kustomize
//! directories (`deploy/`, `deploy/namespaced/`) and the release manifests (`deploy/release/`),
//! rendered with the kubectl the control plane build gives and the helm the tests build.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use serde::Deserialize;

/// The labels Helm adds to the objects of a release, beyond those `deploy/` gives.
const HELM_LABELS: [&str; 4] = [
    "helm.sh/chart",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
];

fn repo(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// Runs `cmd`, failing the test unless it succeeds; its standard output.
fn stdout(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn kustomize(dir: &str) -> String {
    stdout(
        Command::new(super::common::controlplane::binaries().join("kubectl"))
            .arg("kustomize")
            .arg(repo(dir)),
    )
}

fn helm_template(namespace: &str, sets: &[&str]) -> Command {
    let mut cmd = Command::new(super::helm());
    cmd.args(["template", "ebb"])
        .arg(repo("deploy/chart"))
        .args(["--namespace", namespace, "--include-crds"]);
    for set in sets {
        cmd.args(["--set", set]);
    }
    cmd
}

/// (kind, namespace, name).
type Key = (String, String, String);

/// The objects of a stream of YAML documents, by kind, namespace and name.
fn objects(yaml: &str) -> BTreeMap<Key, serde_json::Value> {
    let mut out = BTreeMap::new();
    for doc in yaml_serde::Deserializer::from_str(yaml) {
        let mut object = serde_json::Value::deserialize(doc).expect("a YAML document");
        whole_numbers(&mut object);
        if object.is_null() {
            continue;
        }
        let field = |f: &str| object["metadata"][f].as_str().unwrap_or("").to_owned();
        let key = (
            object["kind"].as_str().unwrap_or("").to_owned(),
            field("namespace"),
            field("name"),
        );
        assert!(out.insert(key.clone(), object).is_none(), "{key:?} twice");
    }
    out
}

/// Numbers as kustomize writes them: `0.0` is `0`.
fn whole_numbers(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Number(n) => {
            if let Some(f) = n.as_f64().filter(|f| f.fract() == 0.0 && f.abs() < 1e15) {
                *value = serde_json::Value::from(f as i64);
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(whole_numbers),
        serde_json::Value::Object(fields) => fields.values_mut().for_each(whole_numbers),
        _ => {}
    }
}

/// `objects`, with the labels Helm adds taken off (each object rendered from a template must
/// carry them all).
fn without_helm_labels(yaml: &str) -> BTreeMap<Key, serde_json::Value> {
    let mut objects = objects(yaml);
    for (key, object) in &mut objects {
        let labels = object["metadata"]["labels"]
            .as_object_mut()
            .unwrap_or_else(|| panic!("{key:?} has no labels"));
        if key.0 != "CustomResourceDefinition" {
            for label in HELM_LABELS {
                assert!(labels.remove(label).is_some(), "{key:?} lacks {label}");
            }
        }
    }
    objects
}

/// Fails with the first object that differs, as two JSON texts.
fn assert_same(
    what: &str,
    want: &BTreeMap<Key, serde_json::Value>,
    got: &BTreeMap<Key, serde_json::Value>,
) {
    assert_eq!(
        want.keys().collect::<Vec<_>>(),
        got.keys().collect::<Vec<_>>(),
        "{what}: not the same objects"
    );
    for (key, object) in want {
        assert!(
            object == &got[key],
            "{what}: {key:?} differs\nwant {}\ngot  {}",
            serde_json::to_string_pretty(object).unwrap(),
            serde_json::to_string_pretty(&got[key]).unwrap()
        );
    }
}

/// `helm template` of the chart with its default values gives the objects `kubectl kustomize
/// deploy/` gives, but the labels Helm adds and the Namespace (Helm installs into a namespace it
/// is given, `--create-namespace`, and `helm uninstall` must not delete it with the volumes in
/// it); with `scope=namespace`, those of `deploy/namespaced/`. `helm lint` finds nothing.
#[test]
fn the_chart_renders_the_objects_kustomize_renders() {
    let lint = stdout(
        Command::new(super::helm())
            .args(["lint", "--strict"])
            .arg(repo("deploy/chart")),
    );
    assert!(lint.contains("0 chart(s) failed"), "{lint}");
    assert!(
        !lint.contains("[WARNING]") && !lint.contains("[ERROR]"),
        "{lint}"
    );

    for (dir, sets) in [
        ("deploy", &[][..]),
        ("deploy/namespaced", &["scope=namespace"][..]),
    ] {
        let mut want = objects(&kustomize(dir));
        let namespace = want.remove(&("Namespace".into(), String::new(), "ebb".into()));
        assert!(namespace.is_some(), "{dir} makes the namespace ebb");
        let got = without_helm_labels(&stdout(&mut helm_template("ebb", sets)));
        assert_same(&format!("helm template {sets:?} vs {dir}"), &want, &got);
    }
}

/// A release in another namespace names its cluster-scoped objects after that namespace, so it
/// does not take over the first release's; everything else is in its namespace.
#[test]
fn a_release_in_another_namespace_keeps_its_cluster_objects_apart() {
    let got = objects(&stdout(&mut helm_template("preview", &[])));
    let cluster: Vec<&Key> = got
        .keys()
        .filter(|(kind, ns, _)| ns.is_empty() && kind != "CustomResourceDefinition")
        .collect();
    assert_eq!(
        cluster,
        [
            &("ClusterRole".into(), String::new(), "ebb-preview".into()),
            &(
                "ClusterRoleBinding".into(),
                String::new(),
                "ebb-preview".into()
            ),
            &(
                "ClusterRoleBinding".into(),
                String::new(),
                "ebb-preview-auth-delegator".into()
            ),
        ]
    );
    let binding = &got[&(
        "ClusterRoleBinding".into(),
        String::new(),
        "ebb-preview".into(),
    )];
    assert_eq!(binding["roleRef"]["name"], "ebb-preview");
    assert_eq!(binding["subjects"][0]["namespace"], "preview");
    for (kind, ns, name) in got.keys() {
        assert!(ns == "preview" || ns.is_empty(), "{kind} {name} is in {ns}");
    }
}

/// `kafka.config` becomes `--kafka-config` arguments, and `kafka.configSecretName` a Secret
/// mounted read-only whose `kafka.properties` ebb reads (`--kafka-config-file`), so a SASL
/// password stays out of the arguments.
#[test]
fn the_charts_kafka_properties_reach_ebb_and_a_secret_holds_the_rest() {
    // A values file, as an install gives one: its numbers are floats to Helm.
    let dir = tempfile::tempdir().unwrap();
    let values = dir.path().join("values.yaml");
    std::fs::write(
        &values,
        "kafka:\n  brokers: kafka:9092\n  configSecretName: ebb-kafka\n  config:\n    \
         security.protocol: SASL_SSL\n    producer.linger.ms: 5\n    \
         consumer.fetch.max.bytes: 52428800\n",
    )
    .unwrap();
    let got = objects(&stdout(
        helm_template("ebb", &[]).arg("--values").arg(&values),
    ));
    let set = &got[&("StatefulSet".into(), "ebb".into(), "ebb".into())];
    let pod = &set["spec"]["template"]["spec"];
    let ebb = &pod["containers"][0];
    let args: Vec<&str> = ebb["args"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a.as_str())
        .filter(|a| a.starts_with("--kafka"))
        .collect();
    assert_eq!(
        args,
        [
            "--kafka-brokers=kafka:9092",
            "--kafka-topic=ebb-calls",
            "--kafka-config=consumer.fetch.max.bytes=52428800",
            "--kafka-config=producer.linger.ms=5",
            "--kafka-config=security.protocol=SASL_SSL",
            "--kafka-config-file=/etc/ebb/kafka/kafka.properties",
        ]
    );
    let mounts = ebb["volumeMounts"].as_array().unwrap();
    let mount = mounts.iter().find(|m| m["name"] == "kafka-config").unwrap();
    assert_eq!(mount["mountPath"], "/etc/ebb/kafka");
    assert_eq!(mount["readOnly"], true);
    let volumes = pod["volumes"].as_array().unwrap();
    let volume = volumes
        .iter()
        .find(|v| v["name"] == "kafka-config")
        .unwrap();
    assert_eq!(volume["secret"]["secretName"], "ebb-kafka");
}

/// Values the chart does not know, or of the wrong kind, are refused by its schema with the
/// field named.
#[test]
fn the_chart_refuses_bad_values_by_name() {
    for (set, says) in [
        ("scope=everywhere", "/scope"),
        ("replica=3", "'replica' not allowed"),
        ("storage.size=lots", "/storage/size"),
        ("kafka.config.acks[0]=all", "/kafka/config/acks"),
    ] {
        let out = helm_template("ebb", &[set]).output().unwrap();
        assert!(!out.status.success(), "{set} was taken");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{set}: {err}");
    }
}

/// `deploy/release/` holds what `scripts/manifests` renders from `deploy/` now: the CRDs, and
/// the rest; together they are `kubectl kustomize deploy/`. The chart, the image that `deploy/`
/// names and Cargo.toml give one version, which CHANGELOG.md has a section for, breaking changes
/// first.
#[test]
fn the_release_manifests_are_rendered_from_deploy() {
    let version = env!("CARGO_PKG_VERSION");
    let mut together = BTreeMap::new();
    for (file, from) in [
        ("ebb-crds.yaml", "deploy/chart/crds"),
        ("ebb.yaml", "deploy/base"),
    ] {
        let kept = std::fs::read_to_string(repo("deploy/release").join(file)).unwrap();
        let (header, body) = kept.split_once('\n').unwrap();
        assert!(
            header.starts_with(&format!("# ebb {version}: ")),
            "{file}: {header}"
        );
        assert!(
            body == kustomize(from),
            "deploy/release/{file} is stale: run scripts/manifests"
        );
        together.append(&mut objects(body));
    }
    assert_same(
        "deploy/release vs deploy/",
        &objects(&kustomize("deploy")),
        &together,
    );

    let chart: serde_json::Value =
        yaml_serde::from_str(&std::fs::read_to_string(repo("deploy/chart/Chart.yaml")).unwrap())
            .unwrap();
    assert_eq!(chart["version"], version);
    assert_eq!(chart["appVersion"], version);
    let image = objects(&kustomize("deploy"))[&("StatefulSet".into(), "ebb".into(), "ebb".into())]
        ["spec"]["template"]["spec"]["containers"][0]["image"]
        .clone();
    assert_eq!(image, format!("ghcr.io/ebb-dev/ebb:{version}"));
    // The CHANGELOG says what this version breaks.
    let changelog = std::fs::read_to_string(repo("CHANGELOG.md")).unwrap();
    let section = changelog
        .split_once(&format!("\n## [{version}]"))
        .unwrap_or_else(|| panic!("CHANGELOG.md has no section for {version}"))
        .1;
    let section = section.split("\n## [").next().unwrap();
    assert!(section.contains("### Breaking"), "{section}");
}
