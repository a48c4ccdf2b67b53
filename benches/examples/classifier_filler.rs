//! Fills a node's pinned IPv4 classification trie with filler entries, or
//! takes them out again, to measure what the trie's size costs real
//! traffic (docs/ebpf.md, "The classifier at scale"):
//! `classifier_filler PIN_DIR COUNT add|remove|check`.
//!
//! Entry `n` is what a node with `COUNT` pod addresses, ten per policy,
//! would hold: source `10.244.0.0 + n` (the lab's pod range, so that the
//! entries crowd the path a real pod's lookup takes), destination
//! `100.64.0.0/10`'s `/24` number `n / 10`, verdict "leave alone". No real
//! destination is in `100.64.0.0/10`, so no packet's verdict changes; only
//! the trie grows. An agent removes entries it did not write when it reads
//! its maps back (at least every 20 reconciles): `check` counts how many of
//! every 1 000th entry are still there.

use std::net::Ipv4Addr;
use std::path::Path;

use aya::maps::lpm_trie::Key;
use aya::maps::{LpmTrie, Map, MapData};
use egressgw_common::{CLASSIFY4, Key4, Verdict, kind};

fn key(n: u32) -> Key<Key4> {
    let src = Ipv4Addr::from(0x0af4_0000 + n).octets();
    let dst = Ipv4Addr::from(0x6440_0000 + ((n / 10) << 8)).octets();
    Key::new(32 + 24, Key4 { src, dst })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [dir, count, what] = args.as_slice() else {
        return Err("usage: classifier_filler PIN_DIR COUNT add|remove|check".into());
    };
    let count: u32 = count.parse()?;
    let pin = Path::new(dir).join(CLASSIFY4);
    let data = MapData::from_pin(&pin).map_err(|e| format!("{}: {e}", pin.display()))?;
    let mut trie: LpmTrie<MapData, Key4, Verdict> = LpmTrie::try_from(Map::LpmTrie(data))?;
    let leave = Verdict {
        kind: kind::LEAVE,
        mark: 0,
        mask: 0,
        counter: 0,
    };
    let start = std::time::Instant::now();
    match what.as_str() {
        "add" => {
            for n in 0..count {
                trie.insert(&key(n), leave, 0)?;
            }
        }
        "remove" => {
            for n in 0..count {
                // An entry already gone is no error.
                let _ = trie.remove(&key(n));
            }
        }
        "check" => {
            let sample: Vec<u32> = (0..count).step_by(1000).collect();
            let present = sample
                .iter()
                .filter(|n| trie.get(&key(**n), 0).is_ok())
                .count();
            println!("{present} of {} sampled entries present", sample.len());
            return Ok(());
        }
        other => return Err(format!("{other}: add, remove or check").into()),
    }
    println!("{what} {count} entries: {:?}", start.elapsed());
    Ok(())
}
