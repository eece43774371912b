//! `ebb bench discovery`: nanoseconds per pick of each load balancer over 3, 100, 1,000 and
//! 10,000 instances, against the cheapest pick there is measured in the same run (one uniform
//! random index from the same generator), on one thread. Picks go through the same
//! [`Picker::pick`] the proxy calls, with a filter that keeps every instance, and the
//! power-of-choices balancers see requests under way (a quarter of the instances busy).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::clock::Stopwatch;
use crate::discovery::{Balancer, HashOn, Instance, PickAt, Picker, Policy, hash_key};

/// Arguments of `ebb bench discovery`.
#[derive(Debug, Clone, clap::Args)]
pub struct DiscoveryBenchArgs {
    /// Milliseconds each measurement runs.
    #[arg(long, default_value_t = 300)]
    pub millis: u64,
    /// Instance counts measured.
    #[arg(long, value_delimiter = ',', default_value = "3,100,1000,10000")]
    pub sizes: Vec<usize>,
}

/// Runs `f` in batches for about `millis`; nanoseconds per call.
fn per_call(millis: u64, mut f: impl FnMut(u64) -> usize) -> f64 {
    let budget = Duration::from_millis(millis);
    let sw = Stopwatch::start();
    let (mut calls, mut sink) = (0u64, 0usize);
    while sw.elapsed() < budget {
        for _ in 0..1_000 {
            sink = sink.wrapping_add(f(calls));
            calls += 1;
        }
    }
    std::hint::black_box(sink);
    sw.elapsed().as_nanos() as f64 / calls as f64
}

/// Runs the benchmark and prints its table.
pub fn run(args: DiscoveryBenchArgs) -> Result<()> {
    println!(
        "ns per pick, one thread, {} ms per cell; anchor: one uniform random index (ChaCha8)",
        args.millis
    );
    print!("{:<22}", "balancer");
    for n in &args.sizes {
        print!("{:>18}", format!("n={n}"));
    }
    println!();
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut anchor = Vec::new();
    print!("{:<22}", "anchor (random index)");
    for &n in &args.sizes {
        let ns = per_call(args.millis, |_| {
            ((rng.next_u64() as u128 * n as u128) >> 64) as usize
        });
        anchor.push(ns);
        print!("{:>18}", format!("{ns:.1}"));
    }
    println!();
    for b in Balancer::ALL {
        let mut policy = Policy::of(b);
        policy.hash_on = Some(HashOn::Path);
        print!("{:<22}", b.name());
        for (k, &n) in args.sizes.iter().enumerate() {
            let items: Vec<Instance> = (0..n)
                .map(|i| {
                    let addr =
                        SocketAddr::from(([10, (i >> 16) as u8, (i >> 8) as u8, i as u8], 8080));
                    Instance::new(addr, 1 + (i % 4) as u32, 0, 30)
                })
                .collect();
            for (i, it) in items.iter().enumerate() {
                if i % 4 == 0 {
                    it.try_begin(0);
                }
                it.set_load_factor((i % 10) as f64 / 10.0);
            }
            let picker = Picker::new(&policy, items, &mut rng);
            let keys: Vec<u64> = (0..1_024u64).map(|k| hash_key(&k.to_le_bytes())).collect();
            let ns = per_call(args.millis, |c| {
                let at = PickAt {
                    now_us: 1_000_000,
                    key: Some(keys[(c & 1_023) as usize]),
                };
                picker.pick(&at, &mut rng, |_| true).unwrap_or(0)
            });
            print!("{:>18}", format!("{ns:.1} ({:.1}x)", ns / anchor[k]));
        }
        println!();
    }
    Ok(())
}
