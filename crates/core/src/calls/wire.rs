//! The runner API's shapes, written as JSON (the default, what people read and write) or as
//! MessagePack ([`Format`]: `application/msgpack`, what ebb's own runners and replicas send, with
//! the same field names). Bodies travel as text when they are UTF-8 and as base64
//! (`body_base64`) when they are not, so people can read them and bytes survive.

use base64::Engine as _;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::{Finish, Job, NewCall};
use crate::event::{CallKind, CallResult, CallSpec, Outcome, Payload};

/// The MessagePack media type.
pub const MSGPACK: &str = "application/msgpack";

/// How a runner API body is written. JSON unless a request's `Content-Type` (for its body) or
/// `Accept` (for its answer) names [`MSGPACK`]: ebb's runners and replicas send MessagePack,
/// whose strings are length-prefixed (nothing to escape, scan or unescape); serde_json was
/// about a tenth of the process on the call path over HTTP. Errors are JSON either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Json,
    Msgpack,
}

impl Format {
    /// The format of a body whose `Content-Type` is `ct`: MessagePack only when it says so.
    pub fn of_content_type(ct: Option<&[u8]>) -> Self {
        match ct {
            Some(ct) if Self::names_msgpack(ct) => Self::Msgpack,
            _ => Self::Json,
        }
    }

    /// The format an `Accept` asks for: MessagePack when it names it (no weights are weighed:
    /// a client that lists it takes it), JSON otherwise.
    pub fn of_accept(accept: Option<&[u8]>) -> Self {
        match accept {
            Some(a) if a.split(|b| *b == b',').any(Self::names_msgpack) => Self::Msgpack,
            _ => Self::Json,
        }
    }

    /// Whether a media type (parameters allowed) is [`MSGPACK`].
    fn names_msgpack(media: &[u8]) -> bool {
        let essence = media.split(|b| *b == b';').next().unwrap_or_default();
        essence
            .trim_ascii()
            .eq_ignore_ascii_case(MSGPACK.as_bytes())
    }

    /// Its media type, for `Content-Type` and `Accept`.
    pub fn media_type(self) -> &'static str {
        match self {
            Self::Json => "application/json",
            Self::Msgpack => MSGPACK,
        }
    }

    /// `value` written in this format. MessagePack is written with field names and as a
    /// human-readable format (addresses, ids and times as the strings JSON has), so both
    /// formats read the same fields, optional and unknown, the same way, and a JSON value
    /// written as MessagePack reads as the type it stands for.
    pub fn encode<T: Serialize + ?Sized>(self, value: &T) -> Result<Vec<u8>, String> {
        match self {
            Self::Json => serde_json::to_vec(value).map_err(|e| e.to_string()),
            Self::Msgpack => {
                let mut out = Vec::new();
                let mut ser = rmp_serde::Serializer::new(&mut out)
                    .with_struct_map()
                    .with_human_readable();
                value.serialize(&mut ser).map_err(|e| e.to_string())?;
                Ok(out)
            }
        }
    }

    /// A `T` read from `bytes` in this format; the error says what is wrong.
    pub fn decode<T: DeserializeOwned>(self, bytes: &[u8]) -> Result<T, String> {
        match self {
            Self::Json => serde_json::from_slice(bytes).map_err(|e| e.to_string()),
            Self::Msgpack => {
                let mut de = rmp_serde::Deserializer::from_read_ref(bytes).with_human_readable();
                T::deserialize(&mut de).map_err(|e| e.to_string())
            }
        }
    }

    /// The error code of a body that does not read: `bad_json` or `bad_msgpack`.
    pub fn bad_code(self) -> &'static str {
        match self {
            Self::Json => "bad_json",
            Self::Msgpack => "bad_msgpack",
        }
    }
}

/// How many requests a client sends as JSON after a server refused MessagePack, before it
/// tries MessagePack again (a server updated meanwhile reads it).
pub const JSON_AFTER_REFUSAL: u32 = 1_000;

/// A client's choice of format: MessagePack, and JSON for a while after a server did not read
/// it. A server without MessagePack (an ebb from before it, during a rolling update) reads the
/// body as JSON and answers 400 `bad_json`; another server may answer 415.
#[derive(Debug, Default)]
pub struct Negotiated {
    json_left: std::sync::atomic::AtomicU32,
}

impl Negotiated {
    /// The format of the next request.
    pub fn format(&self) -> Format {
        use std::sync::atomic::Ordering::Relaxed;
        let left = self.json_left.load(Relaxed);
        if left == 0 {
            return Format::Msgpack;
        }
        // Racing requests may each take one: a few more or fewer JSON requests, no harm.
        self.json_left.store(left - 1, Relaxed);
        Format::Json
    }

    /// Whether an answer to a request sent in `sent` says the server did not read MessagePack;
    /// if so the next [`JSON_AFTER_REFUSAL`] requests are JSON, and this one is to be sent again
    /// as JSON.
    pub fn refused(&self, sent: Format, status: u16, body: &[u8]) -> bool {
        let refused = sent == Format::Msgpack
            && (status == 415
                || (status == 400
                    && serde_json::from_slice::<serde_json::Value>(body)
                        .is_ok_and(|v| v["code"] == "bad_json")));
        if refused {
            self.json_left
                .store(JSON_AFTER_REFUSAL, std::sync::atomic::Ordering::Relaxed);
        }
        refused
    }

    /// Sends `body` with `send` in the format of the next request, and once more as JSON if
    /// the server did not read MessagePack ([`Negotiated::refused`]); `look` gives an answer's
    /// status and body. The answer is the last one `send` gave, whatever its status. No IO of
    /// its own: `send` does it.
    pub async fn exchange<A, E, Fut>(
        &self,
        body: &(impl Serialize + ?Sized),
        mut send: impl FnMut(Format, Vec<u8>) -> Fut,
        look: impl Fn(&A) -> (u16, &[u8]),
    ) -> Result<A, E>
    where
        Fut: std::future::Future<Output = Result<A, E>>,
        E: From<Unencodable>,
    {
        let mut format = self.format();
        loop {
            // Written straight from `body` (no `serde_json::Value` in between).
            let encoded = format.encode(body).map_err(Unencodable)?;
            let answer = send(format, encoded).await?;
            let (status, answer_body) = look(&answer);
            if self.refused(format, status, answer_body) {
                format = Format::Json;
                continue;
            }
            return Ok(answer);
        }
    }
}

/// A request body that does not encode in the format asked (a map whose keys are not strings,
/// in JSON): a fault of the caller's types, reported rather than sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a request body that does not encode: {0}")]
pub struct Unencodable(pub String);

// Here rather than beside `PeerError`: `ids` names no module above it.
impl From<Unencodable> for crate::ids::PeerError {
    fn from(e: Unencodable) -> Self {
        crate::ids::PeerError::Unencodable(e.0)
    }
}

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

/// `POST /runner/enqueue`: one call or `{"calls": [...]}`. Read with [`EnqueueBody::read`].
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
    pub fn read(bytes: &[u8], format: Format) -> Result<Self, String> {
        batch_or_one(
            bytes,
            format,
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
    format: Format,
    batch: impl FnOnce(B) -> Option<Result<T, String>>,
    one: impl FnOnce(O) -> T,
) -> Result<T, String> {
    match format.decode::<B>(bytes).map(batch) {
        Ok(Some(read)) => read,
        Ok(None) => format.decode(bytes).map(one),
        Err(batch) => format.decode(bytes).map(one).map_err(|_| batch),
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

/// `POST /runner/finish`: one result or `{"calls": [...]}`. Read with [`FinishBody::read`].
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
    pub fn read(bytes: &[u8], format: Format) -> Result<Self, String> {
        batch_or_one(
            bytes,
            format,
            |b: MaybeFinishBatch| {
                let calls = b.calls?;
                Some(match b.runner {
                    Some(runner) => Ok(Self::Batch { runner, calls }),
                    None => Err("missing field `runner`".into()),
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
        EnqueueBody, FinishBatchRef, FinishBody, FinishJson, FinishJsonRef, Format,
        JSON_AFTER_REFUSAL, JobJson, JobJsonRef, Negotiated, Unencodable,
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

    /// In each format, what `written` writes, its owned shape reads and writes again byte for
    /// byte, and reads back as `value`.
    fn written_alike_and_read_back<T, O>(
        value: &T,
        written: impl serde::Serialize,
        back: impl Fn(O) -> Result<T, String>,
    ) where
        T: PartialEq + std::fmt::Debug,
        O: serde::Serialize + serde::de::DeserializeOwned,
    {
        for format in [Format::Json, Format::Msgpack] {
            let borrowed = format.encode(&written).unwrap();
            let read: O = format.decode(&borrowed).unwrap();
            let copied = format.encode(&read).unwrap();
            assert_eq!(borrowed, copied, "{format:?}");
            assert_eq!(&back(read).unwrap(), value, "{format:?}");
        }
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
        // A batch of them is read as one, in each format.
        for format in [Format::Json, Format::Msgpack] {
            let batch = format
                .encode(&FinishBatchRef::of("r-1", &finishes))
                .unwrap();
            match FinishBody::read(&batch, format).unwrap() {
                FinishBody::Batch { runner, calls } => {
                    assert_eq!(runner, "r-1");
                    let back: Vec<Finish> =
                        calls.into_iter().map(|c| c.finish().unwrap()).collect();
                    assert_eq!(back, finishes);
                }
                other => panic!("a batch, not {other:?}"),
            }
        }
    }

    /// The JSON text as MessagePack: the same values, field names and all.
    fn msgpack(json: &str) -> Vec<u8> {
        let value: serde_json::Value = serde_json::from_str(json).unwrap();
        Format::Msgpack.encode(&value).unwrap()
    }

    /// An enqueue body read from JSON; the same values as MessagePack read alike (the same
    /// calls, or an error as well, naming the same unknown field or missing one).
    fn read(body: &str) -> Result<EnqueueBody, String> {
        let json = EnqueueBody::read(body.as_bytes(), Format::Json);
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(body) {
            let packed = EnqueueBody::read(&msgpack(&v.to_string()), Format::Msgpack);
            alike(&json, &packed, body);
        }
        json
    }

    /// Two reads of the same values alike: both read, to the same, or both refused, naming the
    /// same field when one is named.
    fn alike<T: std::fmt::Debug>(json: &Result<T, String>, packed: &Result<T, String>, body: &str) {
        match (json, packed) {
            (Ok(j), Ok(p)) => assert_eq!(format!("{j:?}"), format!("{p:?}"), "{body}"),
            (Err(j), Err(p)) => {
                for named in ["unknown field", "missing field", "unknown variant"] {
                    if let Some(at) = j.find(named) {
                        // "unknown field `nope`, expected ..." names "unknown field `nope".
                        let field = j[at..].split('`').take(2).collect::<Vec<_>>().join("`");
                        assert!(p.contains(&field), "{body}: {p:?} names {field:?}");
                    }
                }
            }
            (j, p) => panic!("{body}: JSON read {j:?}, MessagePack {p:?}"),
        }
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
        let json = FinishBody::read(body.as_bytes(), Format::Json);
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(body) {
            let packed = FinishBody::read(&msgpack(&v.to_string()), Format::Msgpack);
            alike(&json, &packed, body);
        }
        json
    }

    #[test]
    fn a_body_is_msgpack_only_when_its_headers_say_so() {
        let of = |ct: &str| Format::of_content_type(Some(ct.as_bytes()));
        assert_eq!(of("application/msgpack"), Format::Msgpack);
        assert_eq!(of("Application/MsgPack; charset=binary"), Format::Msgpack);
        assert_eq!(of("application/json"), Format::Json);
        assert_eq!(of("application/msgpackx"), Format::Json);
        assert_eq!(Format::of_content_type(None), Format::Json);
        let accept = |a: &str| Format::of_accept(Some(a.as_bytes()));
        assert_eq!(accept("application/msgpack"), Format::Msgpack);
        assert_eq!(
            accept("application/json;q=0.5, application/msgpack"),
            Format::Msgpack
        );
        assert_eq!(accept("*/*"), Format::Json);
        assert_eq!(accept("application/json"), Format::Json);
        assert_eq!(Format::of_accept(None), Format::Json);
        // Bytes that are not MessagePack are refused with what is wrong, never a panic.
        for bad in [&b""[..], b"\xc1", b"{\"target\": \"a\"}", &[0x81, 0xa6]] {
            assert!(EnqueueBody::read(bad, Format::Msgpack).is_err(), "{bad:?}");
            assert!(FinishBody::read(bad, Format::Msgpack).is_err(), "{bad:?}");
        }
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

    #[test]
    fn a_client_sends_json_for_a_while_after_a_server_did_not_read_msgpack() {
        let n = Negotiated::default();
        assert_eq!(n.format(), Format::Msgpack);
        // Answers that are not a refusal of MessagePack change nothing.
        let bad_msgpack = br#"{"error": "...", "code": "bad_msgpack"}"#;
        assert!(!n.refused(Format::Msgpack, 400, bad_msgpack));
        assert!(!n.refused(Format::Msgpack, 400, b"not json"));
        assert!(!n.refused(Format::Msgpack, 409, br#"{"code": "bad_json"}"#));
        assert!(!n.refused(Format::Json, 400, br#"{"code": "bad_json"}"#));
        assert!(!n.refused(Format::Json, 415, b""));
        assert_eq!(n.format(), Format::Msgpack);
        // An older server read the body as JSON: the next requests are JSON, then MessagePack
        // is tried again.
        assert!(n.refused(
            Format::Msgpack,
            400,
            br#"{"error": "expected value at line 1 column 1", "code": "bad_json"}"#
        ));
        for _ in 0..JSON_AFTER_REFUSAL {
            assert_eq!(n.format(), Format::Json);
        }
        assert_eq!(n.format(), Format::Msgpack);
        // As after a 415.
        assert!(n.refused(Format::Msgpack, 415, b""));
        assert_eq!(n.format(), Format::Json);
    }

    /// Runs an exchange whose sends are ready at once (they answer without IO): one poll.
    fn now<T>(fut: impl std::future::Future<Output = T>) -> T {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match std::pin::pin!(fut).poll(&mut cx) {
            std::task::Poll::Ready(v) => v,
            std::task::Poll::Pending => panic!("the sends were ready: nothing to wait for"),
        }
    }

    #[test]
    fn an_exchange_sends_once_more_as_json_when_the_server_did_not_read_msgpack() {
        let n = Negotiated::default();
        let body = serde_json::json!({ "runner": "r", "max": 2 });
        // An older server: reads every body as JSON.
        let sent = std::cell::RefCell::new(Vec::new());
        let old_server = |format: Format, bytes: Vec<u8>| {
            let status = match serde_json::from_slice::<serde_json::Value>(&bytes) {
                Ok(_) => 200,
                Err(_) => 400,
            };
            sent.borrow_mut().push((format, bytes));
            let answer = if status == 200 {
                b"{}".to_vec()
            } else {
                br#"{"error": "expected value", "code": "bad_json"}"#.to_vec()
            };
            std::future::ready(Ok::<_, Unencodable>((status, answer)))
        };
        fn look((status, body): &(u16, Vec<u8>)) -> (u16, &[u8]) {
            (*status, body)
        }
        let answer = now(n.exchange(&body, old_server, look)).unwrap();
        assert_eq!(answer, (200, b"{}".to_vec()), "the answer to the JSON one");
        assert_eq!(
            *sent.borrow(),
            [
                (Format::Msgpack, Format::Msgpack.encode(&body).unwrap()),
                (Format::Json, Format::Json.encode(&body).unwrap()),
            ],
            "MessagePack first, then the same body as JSON"
        );
        // The next one goes as JSON at once.
        sent.borrow_mut().clear();
        now(n.exchange(&body, old_server, look)).unwrap();
        assert_eq!(sent.borrow().len(), 1);
        assert_eq!(sent.borrow()[0].0, Format::Json);

        // Any other answer is the exchange's, sent once: a refusal of what the body says, or
        // a server error, even to MessagePack.
        let m = Negotiated::default();
        let mut sends = 0;
        let failing = |_: Format, _: Vec<u8>| {
            sends += 1;
            std::future::ready(Ok::<_, Unencodable>((500, b"oops".to_vec())))
        };
        let answer = now(m.exchange(&body, failing, look)).unwrap();
        assert_eq!((answer.0, sends), (500, 1));
        assert_eq!(m.format(), Format::Msgpack, "not a refusal of MessagePack");

        // A send's own error is the exchange's.
        let gone = |_: Format, _: Vec<u8>| {
            std::future::ready(Err::<(u16, Vec<u8>), _>(Unencodable("gone".into())))
        };
        assert_eq!(
            now(m.exchange(&body, gone, look)).unwrap_err(),
            Unencodable("gone".into())
        );

        // A body that does not encode in the format of the moment is not sent: JSON has no
        // map keys that are not strings.
        let unencodable: std::collections::BTreeMap<Vec<u8>, u8> = [(vec![1], 1)].into();
        let mut sends = 0;
        let counting = |_: Format, _: Vec<u8>| {
            sends += 1;
            std::future::ready(Ok::<_, Unencodable>((200, Vec::new())))
        };
        let e = now(n.exchange(&unencodable, counting, look)).unwrap_err();
        assert!(e.0.contains("key must be a string"), "{e}");
        assert_eq!(sends, 0);
    }

    #[test]
    fn a_json_value_written_as_msgpack_reads_as_the_type_it_stands_for() {
        // A load report is written as a JSON value: its addresses are strings there, and read
        // as addresses from either format.
        type Busy = std::collections::BTreeMap<std::net::SocketAddr, u32>;
        let value = serde_json::json!({ "127.0.0.1:9": 2, "[::1]:80": 1 });
        for format in [Format::Json, Format::Msgpack] {
            let busy: Busy = format.decode(&format.encode(&value).unwrap()).unwrap();
            let want: Busy = [
                ("127.0.0.1:9".parse().unwrap(), 2),
                ("[::1]:80".parse().unwrap(), 1),
            ]
            .into_iter()
            .collect();
            assert_eq!(busy, want, "{format:?}");
            // And the typed map written in the format reads back as itself.
            let again: Busy = format.decode(&format.encode(&busy).unwrap()).unwrap();
            assert_eq!(again, want, "{format:?}");
        }
    }
}
