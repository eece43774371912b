//! Traffic policies: which load balancer picks an instance, and how new, failing and absent
//! instances are treated. A policy is plain data (in `ebb.toml`, the admin API and the log); a
//! [`Picker`](crate::discovery::Picker) is a policy applied to one list of instances.
//!
//! Every setting has a default, so `{}` is the default policy (peak EWMA) and
//! `{ balancer = "round_robin" }` changes only the balancer. Unknown fields and out-of-range values
//! are refused when the configuration is loaded ([`Policy::validate`]), never at request time.

use serde::{Deserialize, Serialize};

/// The load balancers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Balancer {
    /// Uniformly at random.
    Random,
    /// At random in proportion to the instances' weights.
    WeightedRandom,
    /// Each in turn.
    RoundRobin,
    /// Smooth weighted round robin: an earliest-deadline-first schedule (each instance's next
    /// turn is `1 / weight` after its last), started at random offsets, so weights are honoured
    /// without bursts and without expanding instances into a list.
    WeightedRoundRobin,
    /// The power of `choices` random choices, the one with the fewest requests under way winning
    /// (with weights: the lowest `(active + 1) ^ bias / weight`).
    LeastRequest,
    /// The power of `choices` random choices, the one with the lowest reported load factor
    /// (`X-Runner-Load: in_flight/capacity`) winning; instances that reported none count their
    /// requests under way.
    MinLoad,
    /// Peak EWMA (Finagle, Linkerd): the power of `choices` random choices, the one with the
    /// lowest `latency estimate * (active + 1)` winning. The estimate jumps to a slower
    /// response at once and decays towards faster ones over `ewma_decay_ms`.
    #[default]
    PeakEwma,
    /// Consistent hashing (Maglev) on a request key (`hash_on`): the same key reaches the same
    /// instance while it is there, and adding or removing an instance moves few keys.
    ConsistentHash,
}

impl Balancer {
    /// All of them, in the order of the documentation.
    pub const ALL: [Balancer; 8] = [
        Balancer::Random,
        Balancer::WeightedRandom,
        Balancer::RoundRobin,
        Balancer::WeightedRoundRobin,
        Balancer::LeastRequest,
        Balancer::MinLoad,
        Balancer::PeakEwma,
        Balancer::ConsistentHash,
    ];

    /// Its name in the configuration.
    pub fn name(self) -> &'static str {
        match self {
            Balancer::Random => "random",
            Balancer::WeightedRandom => "weighted_random",
            Balancer::RoundRobin => "round_robin",
            Balancer::WeightedRoundRobin => "weighted_round_robin",
            Balancer::LeastRequest => "least_request",
            Balancer::MinLoad => "min_load",
            Balancer::PeakEwma => "peak_ewma",
            Balancer::ConsistentHash => "consistent_hash",
        }
    }

    /// The balancer of that name.
    pub fn from_name(name: &str) -> Option<Balancer> {
        Balancer::ALL.into_iter().find(|b| b.name() == name)
    }
}

/// What a consistent hash is computed on.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HashOn {
    /// A request header's value (`header:x-user`).
    Header(String),
    /// A query parameter's value (`query:user`).
    Query(String),
    /// A cookie's value (`cookie:session`).
    Cookie(String),
    /// The request's path.
    Path,
    /// The client's address.
    ClientIp,
}

impl HashOn {
    /// Parses `header:NAME`, `query:NAME`, `cookie:NAME`, `path` or `client_ip`.
    pub fn parse(text: &str) -> Result<HashOn, String> {
        let named = |kind: &str, name: &str| {
            if name.is_empty() || name.bytes().any(|b| b <= b' ' || b >= 0x7f) {
                Err(format!("hash_on {text:?}: the {kind} needs a name"))
            } else {
                Ok(name.to_owned())
            }
        };
        match text.split_once(':') {
            Some(("header", n)) => Ok(HashOn::Header(named("header", n)?.to_ascii_lowercase())),
            Some(("query", n)) => Ok(HashOn::Query(named("query", n)?)),
            Some(("cookie", n)) => Ok(HashOn::Cookie(named("cookie", n)?)),
            None if text == "path" => Ok(HashOn::Path),
            None if text == "client_ip" => Ok(HashOn::ClientIp),
            _ => Err(format!(
                "hash_on {text:?}: expected header:NAME, query:NAME, cookie:NAME, path or client_ip"
            )),
        }
    }
}

impl std::fmt::Display for HashOn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HashOn::Header(n) => write!(f, "header:{n}"),
            HashOn::Query(n) => write!(f, "query:{n}"),
            HashOn::Cookie(n) => write!(f, "cookie:{n}"),
            HashOn::Path => f.write_str("path"),
            HashOn::ClientIp => f.write_str("client_ip"),
        }
    }
}

/// A traffic policy. Fractions are in per cent so that a policy compares exactly.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(default, deny_unknown_fields)]
pub struct Policy {
    /// The load balancer.
    pub balancer: Balancer,
    /// Random choices made by the power-of-choices balancers (clamped to the instances there are).
    pub choices: u32,
    /// How strongly `least_request` with weights avoids busy instances: the exponent of
    /// `active + 1`, in per cent (100: proportionally).
    pub active_request_bias_percent: u32,
    /// Peak EWMA: how fast a latency estimate forgets (the time constant of its decay).
    pub ewma_decay_ms: u64,
    /// Peak EWMA: the latency assumed of an instance not measured yet.
    pub default_rtt_ms: u64,
    /// Consistent hashing: the request key (`header:NAME`, `query:NAME`, `cookie:NAME`, `path`,
    /// `client_ip`). A request without it is placed at random.
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "ser_hash_on",
        deserialize_with = "de_hash_on"
    )]
    #[cfg_attr(feature = "crd", schemars(with = "Option<String>"))]
    pub hash_on: Option<HashOn>,
    /// Slow start: a new instance's share grows over this long (0: off).
    pub slow_start_ms: u64,
    /// Slow start: how the share grows, `(age / window) ^ (100 / aggression)`, in per cent (100:
    /// linearly; higher: faster at first).
    pub slow_start_aggression_percent: u32,
    /// Slow start: the smallest share a new instance gets, in per cent of its weight.
    pub slow_start_min_percent: u32,
    /// Outlier ejection: an instance failing this many times in a row (connection errors, 5xx
    /// answers) is left out for a while (0: never).
    pub eject_after_failures: u32,
    /// Outlier ejection: how long, times the number of ejections so far (at most ten times).
    pub ejection_ms: u64,
    /// Outlier ejection: at most this share of the instances is left out at once (at least one).
    pub max_ejection_percent: u32,
    /// Panic threshold: below this share of instances not ejected, ejections are ignored and
    /// every instance is picked from (0: never).
    pub panic_threshold_percent: u32,
}

fn ser_hash_on<S: serde::Serializer>(h: &Option<HashOn>, s: S) -> Result<S::Ok, S::Error> {
    match h {
        Some(h) => s.serialize_str(&h.to_string()),
        None => s.serialize_none(),
    }
}

fn de_hash_on<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<HashOn>, D::Error> {
    let s = String::deserialize(d)?;
    HashOn::parse(&s)
        .map(Some)
        .map_err(serde::de::Error::custom)
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            balancer: Balancer::PeakEwma,
            choices: 2,
            active_request_bias_percent: 100,
            ewma_decay_ms: 10_000,
            default_rtt_ms: 30,
            hash_on: None,
            slow_start_ms: 0,
            slow_start_aggression_percent: 100,
            slow_start_min_percent: 10,
            eject_after_failures: 5,
            ejection_ms: 30_000,
            max_ejection_percent: 10,
            panic_threshold_percent: 50,
        }
    }
}

impl Policy {
    /// The default policy with another balancer.
    pub fn of(balancer: Balancer) -> Policy {
        Policy {
            balancer,
            ..Policy::default()
        }
    }

    /// Whether it is the default policy (left out of serialized routes).
    pub fn is_default(&self) -> bool {
        *self == Policy::default()
    }

    /// What is wrong with it, if anything.
    pub fn validate(&self) -> Result<(), String> {
        let mut wrong = Vec::new();
        if !(1..=16).contains(&self.choices) {
            wrong.push(format!("choices is {}: 1 to 16", self.choices));
        }
        if self.active_request_bias_percent > 1_000 {
            wrong.push("active_request_bias_percent above 1000".to_owned());
        }
        if self.ewma_decay_ms == 0 {
            wrong.push("ewma_decay_ms is 0".to_owned());
        }
        if self.default_rtt_ms == 0 {
            wrong.push("default_rtt_ms is 0".to_owned());
        }
        if self.balancer == Balancer::ConsistentHash && self.hash_on.is_none() {
            wrong.push("consistent_hash needs hash_on (header:NAME, query:NAME, cookie:NAME, path or client_ip)".to_owned());
        }
        if self.slow_start_aggression_percent == 0 || self.slow_start_aggression_percent > 1_000 {
            wrong.push("slow_start_aggression_percent: 1 to 1000".to_owned());
        }
        for (name, v) in [
            ("slow_start_min_percent", self.slow_start_min_percent),
            ("max_ejection_percent", self.max_ejection_percent),
            ("panic_threshold_percent", self.panic_threshold_percent),
        ] {
            if v > 100 {
                wrong.push(format!("{name} is {v}: at most 100"));
            }
        }
        if self.eject_after_failures > 0 && self.ejection_ms == 0 {
            wrong.push("ejection_ms is 0 while eject_after_failures is set".to_owned());
        }
        if wrong.is_empty() {
            Ok(())
        } else {
            Err(format!("traffic policy: {}", wrong.join("; ")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_read_from_toml_with_defaults_and_refuse_unknown_fields() {
        let p: Policy = toml::from_str("balancer = \"round_robin\"").unwrap();
        assert_eq!(p, Policy::of(Balancer::RoundRobin));
        assert!(Policy::default().is_default());
        let p: Policy =
            toml::from_str("balancer = \"consistent_hash\"\nhash_on = \"header:X-User\"").unwrap();
        assert_eq!(p.hash_on, Some(HashOn::Header("x-user".into())));
        p.validate().unwrap();
        let back: Policy = toml::from_str(&toml::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
        assert!(toml::from_str::<Policy>("balancer = \"fastest\"").is_err());
        assert!(toml::from_str::<Policy>("choises = 2").is_err());
        assert!(toml::from_str::<Policy>("hash_on = \"header:\"").is_err());
        assert!(toml::from_str::<Policy>("hash_on = \"body\"").is_err());
        let e = Policy::of(Balancer::ConsistentHash).validate().unwrap_err();
        assert!(e.contains("needs hash_on"), "{e}");
        let e = Policy {
            choices: 0,
            panic_threshold_percent: 101,
            ..Policy::default()
        }
        .validate()
        .unwrap_err();
        assert!(
            e.contains("choices") && e.contains("panic_threshold_percent"),
            "{e}"
        );
        for b in Balancer::ALL {
            assert_eq!(Balancer::from_name(b.name()), Some(b));
        }
    }
}
