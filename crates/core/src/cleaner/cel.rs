//! A cleaner's conditions: CEL compiled once, evaluated within a bound.
//!
//! Conditions are compiled with the `cel` crate (its standard library and the strings extension)
//! once per change of the cleaner, refusing any free variable that is neither [`TIME`] nor the
//! name of a target passed to the conditions.
//!
//! The `cel` crate has no cost accounting of its own, so compilation rewrites every
//! comprehension (`all`, `exists`, `exists_one`, `map`, `filter`) to pass each step through a
//! function that counts it: an evaluation that takes more than [`Limits::max_steps`] steps, or
//! runs longer than [`Limits::max_time_ms`], stops with [`EvalError::Limit`]. Without loops
//! outside comprehensions, the steps bound the work. Expressions themselves are bounded in
//! length and node count.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use ::cel::common::ast::{CallExpr, EntryExpr, Expr, IdedExpr};
use ::cel::{Context, Env, ExecutionError, Value};

use crate::clock::Stopwatch;

/// The variable that holds the evaluation's time.
pub const TIME: &str = "time";

/// The longest condition accepted, in bytes.
pub const MAX_SOURCE_BYTES: usize = 16 * 1024;

/// The most AST nodes a condition may have.
pub const MAX_NODES: usize = 4_000;

/// The name of the step-counting function compilation inserts (not callable from a condition:
/// a condition that names it is refused).
const STEP: &str = "__ebb_step";

/// How much one evaluation of all of a cleaner's conditions may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Comprehension steps, across all conditions.
    pub max_steps: u64,
    /// Wall time, checked every 1,024 steps.
    pub max_time_ms: u64,
}

impl Limits {
    /// The bounds `ebb serve` was given (`--cel-max-steps`, `--cel-max-time-ms`).
    pub fn of(limits: &crate::limits::Limits) -> Self {
        Self {
            max_steps: limits.cel_max_steps,
            max_time_ms: limits.cel_max_time_ms,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_steps: 1_000_000,
            max_time_ms: 1_000,
        }
    }
}

/// Why conditions did not compile.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("condition {index}: {message}")]
pub struct CompileError {
    /// Which condition (from 0).
    pub index: usize,
    /// What is wrong, readable.
    pub message: String,
}

/// Why an evaluation gave no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EvalError {
    /// A condition's value is not a boolean: the condition is wrong, not retried.
    #[error("condition {index} is {got}, not a boolean")]
    NotBoolean { index: usize, got: String },
    /// A condition failed (a missing field, a bad timestamp...): it may succeed on other data.
    #[error("condition {index}: {message}")]
    Failed { index: usize, message: String },
    /// The evaluation went past its bound.
    #[error("condition {index}: {message}")]
    Limit { index: usize, message: String },
}

/// One compiled condition.
#[derive(Debug)]
struct Condition {
    expr: IdedExpr,
}

/// A cleaner's conditions, compiled: cache it for as long as the conditions do not change.
#[derive(Debug)]
pub struct Conditions {
    conditions: Vec<Condition>,
}

fn env() -> Arc<Env> {
    static ENV: OnceLock<Arc<Env>> = OnceLock::new();
    ENV.get_or_init(|| {
        let mut env = Env::stdlib();
        // `split`, `startsWith`'s siblings and the rest of cel-go's strings library: the
        // cleaner proposal's example splits an annotation.
        ::cel::extensions::strings(&mut env).expect("the strings extension registers once");
        Arc::new(env)
    })
    .clone()
}

/// Identifiers that name types, not variables.
const TYPE_NAMES: &[&str] = &[
    "bool",
    "bytes",
    "double",
    "duration",
    "dyn",
    "int",
    "list",
    "map",
    "null_type",
    "string",
    "timestamp",
    "type",
    "uint",
];

impl Conditions {
    /// Compiles `sources`, whose free variables may be [`TIME`] and `variables`.
    pub fn compile(sources: &[String], variables: &[&str]) -> Result<Conditions, CompileError> {
        let env = env();
        let mut conditions = Vec::with_capacity(sources.len());
        for (index, source) in sources.iter().enumerate() {
            let err = |message: String| CompileError { index, message };
            if source.len() > MAX_SOURCE_BYTES {
                return Err(err(format!(
                    "{} bytes long, more than the {MAX_SOURCE_BYTES} allowed",
                    source.len()
                )));
            }
            if source.trim().is_empty() {
                return Err(err("empty".into()));
            }
            let program = env.compile(source).map_err(|e| err(e.to_string()))?;
            let mut expr = program.expression().clone();
            let mut walk = Walk::default();
            walk.visit(&mut expr);
            if walk.nodes > MAX_NODES {
                return Err(err(format!(
                    "{} expression nodes, more than the {MAX_NODES} allowed",
                    walk.nodes
                )));
            }
            if walk.calls.contains(STEP) {
                return Err(err(format!("{STEP} is reserved")));
            }
            let unknown: Vec<&String> = walk
                .idents
                .iter()
                .filter(|i| {
                    i.as_str() != TIME
                        && !variables.contains(&i.as_str())
                        && !walk.bound.contains(*i)
                        && !TYPE_NAMES.contains(&i.as_str())
                })
                .collect();
            if let Some(first) = unknown.first() {
                let mut known = vec![TIME];
                known.extend(variables);
                return Err(err(format!(
                    "unknown variable `{first}` (known: {})",
                    known.join(", ")
                )));
            }
            conditions.push(Condition { expr });
        }
        Ok(Conditions { conditions })
    }

    /// How many conditions there are.
    pub fn len(&self) -> usize {
        self.conditions.len()
    }

    /// No conditions: a cleaner without any fires once its TTL has passed.
    pub fn is_empty(&self) -> bool {
        self.conditions.is_empty()
    }

    /// Binds the variables once for any number of evaluations at different times.
    pub fn bind(&self, variables: &[(&str, &serde_json::Value)]) -> Bound<'_> {
        let mut ctx = Context::with_env(env());
        for (name, value) in variables {
            ctx.add_variable_from_value(*name, json_to_value(value));
        }
        let meter = Arc::new(Meter::default());
        {
            let meter = meter.clone();
            ctx.add_function(STEP, move |v: Value| -> Result<Value, ExecutionError> {
                meter.step()?;
                Ok(v)
            })
            .expect("the step function's name is free");
        }
        Bound {
            conditions: self,
            ctx,
            meter,
        }
    }
}

/// Counts an evaluation's comprehension steps against its limits.
#[derive(Debug, Default)]
struct Meter {
    steps: AtomicU64,
    limits: Mutex<Option<(Limits, Stopwatch)>>,
}

impl Meter {
    fn reset(&self, limits: Limits) {
        self.steps.store(0, Ordering::Relaxed);
        *self.limits.lock().unwrap_or_else(|e| e.into_inner()) = Some((limits, Stopwatch::start()));
    }

    fn step(&self) -> Result<(), ExecutionError> {
        let n = self.steps.fetch_add(1, Ordering::Relaxed) + 1;
        let guard = self.limits.lock().unwrap_or_else(|e| e.into_inner());
        let Some((limits, watch)) = *guard else {
            return Ok(());
        };
        if n > limits.max_steps {
            return Err(ExecutionError::function_error(
                "limit",
                format!("more than {} comprehension steps", limits.max_steps),
            ));
        }
        if n.is_multiple_of(1_024) && watch.elapsed().as_millis() > u128::from(limits.max_time_ms) {
            return Err(ExecutionError::function_error(
                "limit",
                format!("ran longer than {} ms", limits.max_time_ms),
            ));
        }
        Ok(())
    }
}

/// Conditions with their variables bound: evaluate them at any time.
pub struct Bound<'a> {
    conditions: &'a Conditions,
    ctx: Context<'static, 'static>,
    meter: Arc<Meter>,
}

impl Bound<'_> {
    /// Evaluates every condition at `time_ms` (Unix ms) within `limits`, counted from this
    /// call: each condition's result, or why there is none (the first failure ends it).
    pub fn evaluate(&mut self, time_ms: u64, limits: Limits) -> Result<Vec<bool>, EvalError> {
        self.meter.reset(limits);
        let time = chrono::DateTime::from_timestamp_millis(i64::try_from(time_ms).unwrap_or(0))
            .unwrap_or_default()
            .fixed_offset();
        self.ctx
            .add_variable_from_value(TIME, Value::Timestamp(time));
        let mut results = Vec::with_capacity(self.conditions.len());
        for (index, c) in self.conditions.conditions.iter().enumerate() {
            match Value::resolve(&c.expr, &self.ctx) {
                Ok(Value::Bool(b)) => results.push(b),
                Ok(other) => {
                    return Err(EvalError::NotBoolean {
                        index,
                        got: type_name(&other),
                    });
                }
                Err(ExecutionError::FunctionError { function, message }) if function == "limit" => {
                    return Err(EvalError::Limit { index, message });
                }
                Err(e) => {
                    return Err(EvalError::Failed {
                        index,
                        message: e.to_string(),
                    });
                }
            }
        }
        Ok(results)
    }

    /// Comprehension steps the last evaluation took.
    pub fn steps(&self) -> u64 {
        self.meter.steps.load(Ordering::Relaxed)
    }
}

fn type_name(v: &Value) -> String {
    match v {
        Value::Int(i) => format!("an int ({i})"),
        Value::UInt(u) => format!("a uint ({u})"),
        Value::Float(f) => format!("a double ({f})"),
        Value::String(s) => format!("a string ({s:?})"),
        Value::Null => "null".into(),
        Value::List(_) => "a list".into(),
        Value::Map(_) => "a map".into(),
        Value::Timestamp(_) => "a timestamp".into(),
        Value::Duration(_) => "a duration".into(),
        Value::Bytes(_) => "bytes".into(),
        _ => "not a boolean".into(),
    }
}

/// A JSON value as CEL sees it: numbers that are integers as `int`, others as `double`.
pub fn json_to_value(v: &serde_json::Value) -> Value {
    use std::collections::HashMap;
    match v {
        serde_json::Value::Null => Value::Null,
        serde_json::Value::Bool(b) => Value::Bool(*b),
        serde_json::Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Value::Int(i),
            (None, Some(u)) => Value::UInt(u),
            _ => Value::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        serde_json::Value::String(s) => Value::String(Arc::new(s.clone())),
        serde_json::Value::Array(a) => {
            Value::List(Arc::new(a.iter().map(json_to_value).collect::<Vec<_>>()))
        }
        serde_json::Value::Object(o) => {
            let m: HashMap<String, Value> = o
                .iter()
                .map(|(k, v)| (k.clone(), json_to_value(v)))
                .collect();
            Value::from(m)
        }
    }
}

/// Counts nodes, collects identifiers, bound comprehension variables and function names, and
/// passes each comprehension step through [`STEP`].
#[derive(Default)]
struct Walk {
    nodes: usize,
    idents: BTreeSet<String>,
    bound: BTreeSet<String>,
    calls: BTreeSet<String>,
}

impl Walk {
    fn visit(&mut self, e: &mut IdedExpr) {
        self.nodes += 1;
        match &mut e.expr {
            Expr::Comprehension(c) => {
                self.bound.insert(c.iter_var.clone());
                if let Some(v) = &c.iter_var2 {
                    self.bound.insert(v.clone());
                }
                self.bound.insert(c.accu_var.clone());
                self.visit(&mut c.iter_range);
                self.visit(&mut c.accu_init);
                self.visit(&mut c.loop_cond);
                self.visit(&mut c.loop_step);
                self.visit(&mut c.result);
                let step = std::mem::take(&mut c.loop_step);
                c.loop_step = IdedExpr {
                    id: step.id,
                    expr: Expr::Call(CallExpr {
                        func_name: STEP.into(),
                        target: None,
                        args: vec![step],
                    }),
                };
            }
            Expr::Call(c) => {
                self.calls.insert(c.func_name.clone());
                if let Some(t) = &mut c.target {
                    self.visit(t);
                }
                for a in &mut c.args {
                    self.visit(a);
                }
            }
            Expr::Ident(name) => {
                self.idents.insert(name.clone());
            }
            Expr::List(l) => {
                for a in &mut l.elements {
                    self.visit(a);
                }
            }
            Expr::Map(m) => {
                for entry in &mut m.entries {
                    self.visit_entry(&mut entry.expr);
                }
            }
            Expr::Struct(s) => {
                for entry in &mut s.entries {
                    self.visit_entry(&mut entry.expr);
                }
            }
            Expr::Select(s) => self.visit(&mut s.operand),
            Expr::Literal(_) | Expr::Unspecified => {}
        }
    }

    fn visit_entry(&mut self, e: &mut EntryExpr) {
        match e {
            EntryExpr::StructField(f) => self.visit(&mut f.value),
            EntryExpr::MapEntry(m) => {
                self.visit(&mut m.key);
                self.visit(&mut m.value);
            }
        }
    }
}
