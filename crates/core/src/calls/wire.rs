//! The runner API's JSON shapes. Bodies travel as text when they are UTF-8 and as base64
//! (`body_base64`) when they are not, so people can read them and bytes survive.

use base64::Engine as _;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::{Finish, Job, NewCall};
use crate::event::{CallKind, CallResult, CallSpec, Outcome, Payload};

/// An HTTP request or answer as JSON, as read ([`MessageJsonRef`] writes it).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageJson {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    #[serde(default)]
    pub headers: Vec<(String, String)>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_base64: Option<String>,
}

impl MessageJson {
    /// The body's bytes: a text body's own (not a copy), or base64's decoded.
    fn body_bytes(
        body: Option<String>,
        body_base64: Option<String>,
    ) -> Result<serde_bytes::ByteBuf, String> {
        match (body, body_base64) {
            (Some(_), Some(_)) => Err("give a body as body or body_base64, not both".into()),
            (Some(t), None) => Ok(t.into_bytes().into()),
            (None, Some(b)) => base64::engine::general_purpose::STANDARD
                .decode(b.as_bytes())
                .map(Into::into)
                .map_err(|e| format!("body_base64: {e}")),
            (None, None) => Ok(Default::default()),
        }
    }

    /// Back to a call's request (its strings moved, not copied).
    pub fn into_payload(self) -> Result<Payload, String> {
        Ok(Payload {
            body: Self::body_bytes(self.body, self.body_base64)?,
            method: self.method.unwrap_or_else(|| "POST".into()),
            path: self.path.unwrap_or_else(|| "/".into()),
            headers: self.headers,
        })
    }

    /// Back to a call's result (its strings moved, not copied).
    pub fn into_result(self) -> Result<CallResult, String> {
        Ok(CallResult {
            status: self.status.ok_or("a result needs a status")?,
            body: Self::body_bytes(self.body, self.body_base64)?,
            headers: self.headers,
        })
    }
}

/// A job as JSON, as a runner reads it ([`JobJsonRef`] writes it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobJson {
    pub id: String,
    pub target: String,
    pub host: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<crate::discovery::Policy>,
    pub timeout_ms: u64,
    pub deliveries: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition: Option<String>,
    pub payload: MessageJson,
}

impl JobJson {
    /// The job (its strings moved, not copied).
    pub fn into_job(self) -> Result<Job, String> {
        Ok(Job {
            call: std::sync::Arc::new(CallSpec {
                payload: self.payload.into_payload()?,
                id: self.id,
                target: self.target,
                kind: CallKind::Async,
                timeout_ms: self.timeout_ms,
                partition: self.partition,
                trace: None,
                tracestate: None,
                baggage: None,
            }),
            host: self.host,
            address: self.address,
            policy: self.policy,
            deliveries: self.deliveries,
        })
    }
}

/// A job as JSON, written from the job itself (each dequeue answer writes one per call, and
/// copies none of their strings).
#[derive(Serialize)]
pub struct JobJsonRef<'a> {
    id: &'a str,
    target: &'a str,
    host: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    address: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    policy: Option<&'a crate::discovery::Policy>,
    timeout_ms: u64,
    deliveries: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    partition: Option<&'a str>,
    payload: MessageJsonRef<'a>,
}

/// A request or answer as JSON, written from it.
#[derive(Serialize)]
pub struct MessageJsonRef<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    method: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    path: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<u16>,
    headers: &'a [(String, String)],
    #[serde(skip_serializing_if = "Option::is_none")]
    body: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    body_base64: Option<String>,
}

impl<'a> MessageJsonRef<'a> {
    /// Text when the bytes are UTF-8 (borrowed), base64 otherwise.
    fn body(bytes: &'a [u8]) -> (Option<&'a str>, Option<String>) {
        match std::str::from_utf8(bytes) {
            Ok(text) => (Some(text), None),
            Err(_) => (
                None,
                Some(base64::engine::general_purpose::STANDARD.encode(bytes)),
            ),
        }
    }

    /// A call's request.
    pub fn of_payload(p: &'a Payload) -> Self {
        let (body, body_base64) = Self::body(&p.body);
        Self {
            method: Some(&p.method),
            path: Some(&p.path),
            status: None,
            headers: &p.headers,
            body,
            body_base64,
        }
    }

    /// A call's result.
    pub fn of_result(r: &'a CallResult) -> Self {
        let (body, body_base64) = Self::body(&r.body);
        Self {
            method: None,
            path: None,
            status: Some(r.status),
            headers: &r.headers,
            body,
            body_base64,
        }
    }
}

impl<'a> JobJsonRef<'a> {
    pub fn of(job: &'a Job) -> Self {
        Self {
            id: &job.call.id,
            target: &job.call.target,
            host: &job.host,
            address: job.address.as_deref(),
            policy: job.policy.as_ref(),
            timeout_ms: job.call.timeout_ms,
            deliveries: job.deliveries,
            partition: job.call.partition.as_deref(),
            payload: MessageJsonRef::of_payload(&job.call.payload),
        }
    }
}

/// A finish as JSON, written from the finish itself.
#[derive(Serialize)]
pub struct FinishJsonRef<'a> {
    id: &'a str,
    outcome: Outcome,
    #[serde(skip_serializing_if = "Option::is_none")]
    result: Option<MessageJsonRef<'a>>,
    log: &'a str,
}

impl<'a> FinishJsonRef<'a> {
    pub fn of(f: &'a Finish) -> Self {
        Self {
            id: &f.id,
            outcome: f.outcome,
            result: f.result.as_ref().map(MessageJsonRef::of_result),
            log: &f.log,
        }
    }
}

/// A finish as JSON, as read ([`FinishJsonRef`] writes it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FinishJson {
    pub id: String,
    pub outcome: Outcome,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<MessageJson>,
    #[serde(default)]
    pub log: String,
}

impl FinishJson {
    pub fn finish(self) -> Result<Finish, String> {
        Ok(Finish {
            id: self.id,
            outcome: self.outcome,
            result: self.result.map(MessageJson::into_result).transpose()?,
            log: self.log,
        })
    }
}

/// `POST /runner/enqueue`: one call or `{"calls": [...]}`. Read with [`EnqueueBody::from_json`].
/// Parsed once per request: the size of its one call does not matter.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum EnqueueBody {
    Batch { calls: Vec<NewCall> },
    One(NewCall),
}

/// A body that may be a batch: anything but `calls` is left for [`NewCall`] to judge.
#[derive(Deserialize)]
struct MaybeBatch {
    #[serde(default)]
    calls: Option<Vec<NewCall>>,
}

impl EnqueueBody {
    /// Reads a body: a batch if it has `calls`, else one call ([`batch_or_one`]).
    pub fn from_json(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        batch_or_one(
            bytes,
            |b: MaybeBatch| b.calls.map(|calls| Ok(Self::Batch { calls })),
            Self::One,
        )
    }
}

/// Reads a body that is a batch `B` when it has `calls` (`batch` says, `None` for no `calls`),
/// else one `O`, each straight from the bytes: an untagged enum would first copy the whole body
/// into a tree of strings and read that once per variant (the enqueue's largest cost after the
/// log). The error is the one that tells what is wrong: the batch's when the body has `calls`
/// or is no JSON object, the one's otherwise.
fn batch_or_one<T, B: DeserializeOwned, O: DeserializeOwned>(
    bytes: &[u8],
    batch: impl FnOnce(B) -> Option<Result<T, serde_json::Error>>,
    one: impl FnOnce(O) -> T,
) -> Result<T, serde_json::Error> {
    match serde_json::from_slice::<B>(bytes).map(batch) {
        Ok(Some(read)) => read,
        Ok(None) => serde_json::from_slice(bytes).map(one),
        Err(batch) => serde_json::from_slice(bytes).map(one).map_err(|_| batch),
    }
}

/// `POST /runner/dequeue`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DequeueBody {
    pub runner: String,
    #[serde(default)]
    pub max: Option<usize>,
    #[serde(default)]
    pub wait_ms: Option<u64>,
}

/// `POST /runner/start`: one id or several.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartBody {
    pub runner: String,
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default)]
    pub ids: Option<Vec<String>>,
    /// From another replica forwarding a start: the copies (base64 of the queue message's
    /// body) of calls it handed out while this replica, their owner, did not know them yet.
    /// The owner records such a call from its copy before deciding the start, so a call whose
    /// record was stalled past the hold-back bound still runs.
    #[serde(default)]
    pub copies: Option<std::collections::BTreeMap<String, String>>,
}

/// `POST /runner/finish` with a batch, as a runner or a replica forwarding finishes writes it
/// (read as [`FinishBody::Batch`]).
#[derive(Serialize)]
pub struct FinishBatchRef<'a> {
    runner: &'a str,
    calls: Vec<FinishJsonRef<'a>>,
}

impl<'a> FinishBatchRef<'a> {
    pub fn of(runner: &'a str, finishes: &'a [Finish]) -> Self {
        Self {
            runner,
            calls: finishes.iter().map(FinishJsonRef::of).collect(),
        }
    }
}

/// `POST /runner/finish`: one result or `{"calls": [...]}`. Read with [`FinishBody::from_json`].
#[derive(Debug)]
pub enum FinishBody {
    Batch {
        runner: String,
        calls: Vec<FinishJson>,
    },
    One {
        runner: String,
        call: FinishJson,
    },
}

/// A finish body that may be a batch: anything but `runner` and `calls` is left for
/// [`OneFinish`] to judge.
#[derive(Deserialize)]
struct MaybeFinishBatch {
    #[serde(default)]
    runner: Option<String>,
    #[serde(default)]
    calls: Option<Vec<FinishJson>>,
}

/// One finish with its runner: [`FinishJson`]'s fields and `runner`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OneFinish {
    runner: String,
    id: String,
    outcome: Outcome,
    #[serde(default)]
    result: Option<MessageJson>,
    #[serde(default)]
    log: String,
}

impl FinishBody {
    /// Reads a body: a batch if it has `calls` (and then its `runner`), else one finish
    /// ([`batch_or_one`]).
    pub fn from_json(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        batch_or_one(
            bytes,
            |b: MaybeFinishBatch| {
                let calls = b.calls?;
                Some(match b.runner {
                    Some(runner) => Ok(Self::Batch { runner, calls }),
                    None => Err(serde::de::Error::missing_field("runner")),
                })
            },
            |o: OneFinish| Self::One {
                runner: o.runner,
                call: FinishJson {
                    id: o.id,
                    outcome: o.outcome,
                    result: o.result,
                    log: o.log,
                },
            },
        )
    }
}

/// `POST /runner/states`: the states of calls this replica owns (asked by another replica).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatesBody {
    pub ids: Vec<String>,
}

/// Checks a runner's id: 1 to 128 of `A-Z a-z 0-9 . _ -`.
pub fn check_runner(id: &str) -> Result<&str, String> {
    if id.is_empty()
        || id.len() > 128
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    {
        return Err(format!("runner id {id:?}: 1 to 128 of A-Z a-z 0-9 . _ -"));
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::{
        EnqueueBody, FinishBatchRef, FinishBody, FinishJson, FinishJsonRef, JobJson, JobJsonRef,
    };
    use crate::calls::{Finish, Job};
    use crate::discovery::{Balancer, Policy};
    use crate::event::{CallResult, CallSpec, Outcome, Payload};

    /// Jobs with and without each optional field, with a text and a binary body.
    fn jobs() -> Vec<Job> {
        let plain = CallSpec::for_test("c-1");
        let mut full = CallSpec::for_test("c-2");
        full.partition = Some("runner-1".into());
        full.payload = Payload {
            method: "PUT".into(),
            path: "/a?b=\"c\"".into(),
            headers: vec![("x-one".into(), "1".into()), ("x-two".into(), "é".into())],
            body: b"caf\xc3\xa9 \"quoted\"\n".to_vec().into(),
        };
        let mut binary = full.clone();
        binary.id = "c-3".into();
        binary.payload.body = vec![0, 159, 146, 150, 255].into();
        vec![
            Job {
                call: plain.into(),
                host: "t.example".into(),
                address: None,
                policy: None,
                deliveries: 1,
            },
            Job {
                call: full.into(),
                host: String::new(),
                address: Some("http://127.0.0.1:9".into()),
                policy: Some(Policy::of(Balancer::RoundRobin)),
                deliveries: 3,
            },
            Job {
                call: binary.into(),
                host: "h".into(),
                address: None,
                policy: None,
                deliveries: 2,
            },
        ]
    }

    /// What `written` writes, its owned shape reads and writes again byte for byte, and reads
    /// back as `value`.
    fn written_alike_and_read_back<T, O>(
        value: &T,
        written: impl serde::Serialize,
        back: impl FnOnce(O) -> Result<T, String>,
    ) where
        T: PartialEq + std::fmt::Debug,
        O: serde::Serialize + serde::de::DeserializeOwned,
    {
        let borrowed = serde_json::to_string(&written).unwrap();
        let read: O = serde_json::from_str(&borrowed).unwrap();
        let copied = serde_json::to_string(&read).unwrap();
        assert_eq!(borrowed, copied);
        assert_eq!(&back(read).unwrap(), value);
    }

    #[test]
    fn a_job_is_written_from_itself_as_its_json_copy_writes_it_and_read_back_whole() {
        for job in jobs() {
            written_alike_and_read_back(&job, JobJsonRef::of(&job), JobJson::into_job);
        }
    }

    #[test]
    fn a_finish_is_written_from_itself_as_its_json_copy_writes_it_and_read_back_whole() {
        let result = |body: &[u8]| CallResult {
            status: 201,
            headers: vec![("content-type".into(), "text/plain".into())],
            body: body.to_vec().into(),
        };
        let finishes = [
            Finish {
                id: "c-1".into(),
                outcome: Outcome::Success,
                result: Some(result(b"d\xc3\xa9j\xc3\xa0 \"vu\"")),
                log: "ran\n".into(),
            },
            Finish {
                id: "c-2".into(),
                outcome: Outcome::Error,
                result: Some(result(&[0xff, 0, 0xfe])),
                log: String::new(),
            },
            Finish {
                id: "c-3".into(),
                outcome: Outcome::Error,
                result: None,
                log: "no answer".into(),
            },
        ];
        for finish in &finishes {
            written_alike_and_read_back(finish, FinishJsonRef::of(finish), FinishJson::finish);
        }
        // A batch of them is read as one.
        let batch = serde_json::to_vec(&FinishBatchRef::of("r-1", &finishes)).unwrap();
        match FinishBody::from_json(&batch).unwrap() {
            FinishBody::Batch { runner, calls } => {
                assert_eq!(runner, "r-1");
                let back: Vec<Finish> = calls.into_iter().map(|c| c.finish().unwrap()).collect();
                assert_eq!(back, finishes);
            }
            other => panic!("a batch, not {other:?}"),
        }
    }

    fn read(body: &str) -> Result<EnqueueBody, String> {
        EnqueueBody::from_json(body.as_bytes()).map_err(|e| e.to_string())
    }

    #[test]
    fn an_enqueue_body_is_a_batch_with_calls_else_one_call() {
        match read(r#"{"calls": [{"target": "a"}, {"target": "b", "id": "x"}]}"#) {
            Ok(EnqueueBody::Batch { calls }) => {
                let targets: Vec<&str> = calls.iter().map(|c| c.target.as_str()).collect();
                assert_eq!(targets, ["a", "b"]);
                assert_eq!(calls[1].id.as_deref(), Some("x"));
            }
            other => panic!("a batch, not {other:?}"),
        }
        match read(r#"{"target": "a", "timeout_ms": 5}"#) {
            Ok(EnqueueBody::One(c)) => {
                assert_eq!((c.target.as_str(), c.timeout_ms), ("a", Some(5)))
            }
            other => panic!("one call, not {other:?}"),
        }
        assert!(matches!(
            read(r#"{"calls": []}"#),
            Ok(EnqueueBody::Batch { calls }) if calls.is_empty()
        ));
    }

    #[test]
    fn a_bad_enqueue_body_is_refused_with_what_is_wrong() {
        // One call with a field calls do not have: the call's error names it.
        let e = read(r#"{"target": "a", "nope": 1}"#).unwrap_err();
        assert!(e.contains("unknown field `nope`"), "{e}");
        // A batch with a bad call: the batch's error, not the one call's.
        let e = read(r#"{"calls": [{"target": 7}]}"#).unwrap_err();
        assert!(e.contains("invalid type"), "{e}");
        // Neither a call nor a batch.
        let e = read(r#"{}"#).unwrap_err();
        assert!(e.contains("missing field `target`"), "{e}");
        assert!(read("{not json").is_err());
        assert!(read(r#""a string""#).is_err());
        assert!(read(r#"{"calls": null}"#).is_err());
    }

    fn finish_body(body: &str) -> Result<FinishBody, String> {
        FinishBody::from_json(body.as_bytes()).map_err(|e| e.to_string())
    }

    #[test]
    fn a_finish_body_is_a_batch_with_calls_else_one_finish() {
        match finish_body(r#"{"runner": "r", "id": "c-1", "outcome": "success", "log": "ok"}"#) {
            Ok(FinishBody::One { runner, call }) => {
                assert_eq!(runner, "r");
                assert_eq!((call.id.as_str(), call.outcome), ("c-1", Outcome::Success));
                assert_eq!((call.result, call.log.as_str()), (None, "ok"));
            }
            other => panic!("one finish, not {other:?}"),
        }
        match finish_body(r#"{"runner": "r", "calls": [{"id": "c-1", "outcome": "error"}]}"#) {
            Ok(FinishBody::Batch { runner, calls }) => {
                assert_eq!(runner, "r");
                assert_eq!(calls.len(), 1);
                assert_eq!(
                    (calls[0].id.as_str(), calls[0].outcome),
                    ("c-1", Outcome::Error)
                );
            }
            other => panic!("a batch, not {other:?}"),
        }
    }

    #[test]
    fn a_bad_finish_body_is_refused_with_what_is_wrong() {
        // One finish with a field finishes do not have: its error names it.
        let e = finish_body(r#"{"runner": "r", "id": "c", "outcome": "success", "nope": 1}"#)
            .unwrap_err();
        assert!(e.contains("unknown field `nope`"), "{e}");
        // A batch with a bad finish: the batch's error.
        let e = finish_body(r#"{"runner": "r", "calls": [{"id": "c", "outcome": "maybe"}]}"#)
            .unwrap_err();
        assert!(e.contains("unknown variant `maybe`"), "{e}");
        // A batch without its runner.
        let e = finish_body(r#"{"calls": []}"#).unwrap_err();
        assert!(e.contains("missing field `runner`"), "{e}");
        // Neither.
        let e = finish_body(r#"{"runner": "r"}"#).unwrap_err();
        assert!(e.contains("missing field `id`"), "{e}");
        assert!(finish_body("{not json").is_err());
        assert!(finish_body(r#"[1]"#).is_err());
    }
}
