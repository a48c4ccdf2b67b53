//! The eBPF datapath's classifier, on TC ingress of the interfaces pod
//! traffic enters a node by.
//!
//! For every IPv4 or IPv6 packet: a destination inside the cluster is left
//! alone; otherwise (source, destination) is looked up in the
//! classification trie (longest prefix, see `egressgw-common`). A hit is
//! counted in its policy's per-CPU counter and then, by its verdict, the
//! packet gets its gateway's mark (the policy routes and the firewall do
//! the rest), is dropped (no live gateway, failing closed), or is left
//! alone. Everything else passes untouched.

#![no_std]
#![no_main]

use aya_ebpf::bindings::{TC_ACT_OK, TC_ACT_SHOT};
use aya_ebpf::macros::{classifier, map};
use aya_ebpf::maps::lpm_trie::Key;
use aya_ebpf::maps::{LpmTrie, PerCpuArray};
use aya_ebpf::programs::TcContext;
use egressgw_common::{
    CLASSIFY_MAX, CLUSTER_MAX, COUNTERS_MAX, Counter, Dst4, Dst6, Key4, Key6, LOOKUP4_BITS,
    LOOKUP6_BITS, Verdict, kind,
};

// The names are egressgw-common's constants; the macro wants literals.
#[map(name = "EGRESSGW_CLASSIFY4")]
static CLASSIFY4: LpmTrie<Key4, Verdict> = LpmTrie::with_max_entries(CLASSIFY_MAX, 0);
#[map(name = "EGRESSGW_CLASSIFY6")]
static CLASSIFY6: LpmTrie<Key6, Verdict> = LpmTrie::with_max_entries(CLASSIFY_MAX, 0);
#[map(name = "EGRESSGW_CLUSTER4")]
static CLUSTER4: LpmTrie<Dst4, u32> = LpmTrie::with_max_entries(CLUSTER_MAX, 0);
#[map(name = "EGRESSGW_CLUSTER6")]
static CLUSTER6: LpmTrie<Dst6, u32> = LpmTrie::with_max_entries(CLUSTER_MAX, 0);
#[map(name = "EGRESSGW_COUNTERS")]
static COUNTERS: PerCpuArray<Counter> = PerCpuArray::with_max_entries(COUNTERS_MAX, 0);

/// Ethernet header length: where the IP header starts on the interfaces
/// the program attaches to.
const ETH_HLEN: usize = 14;
/// `skb->protocol` values, in network byte order as the field holds them.
const ETH_P_IP: u32 = (0x0800u16).to_be() as u32;
const ETH_P_IPV6: u32 = (0x86ddu16).to_be() as u32;

#[classifier]
pub fn egressgw_classify(ctx: TcContext) -> i32 {
    classify(&ctx).unwrap_or(TC_ACT_OK)
}

/// The verdict for `ctx`'s packet; `None` when it cannot be read (left alone).
fn classify(ctx: &TcContext) -> Option<i32> {
    let verdict = match ctx.skb.protocol() {
        ETH_P_IP => {
            let src: [u8; 4] = ctx.load(ETH_HLEN + 12).ok()?;
            let dst: [u8; 4] = ctx.load(ETH_HLEN + 16).ok()?;
            if CLUSTER4.get(Key::new(32, Dst4 { dst })).is_some() {
                return Some(TC_ACT_OK);
            }
            *CLASSIFY4.get(Key::new(LOOKUP4_BITS, Key4 { src, dst }))?
        }
        ETH_P_IPV6 => {
            let src: [u8; 16] = ctx.load(ETH_HLEN + 8).ok()?;
            let dst: [u8; 16] = ctx.load(ETH_HLEN + 24).ok()?;
            if CLUSTER6.get(Key::new(128, Dst6 { dst })).is_some() {
                return Some(TC_ACT_OK);
            }
            *CLASSIFY6.get(Key::new(LOOKUP6_BITS, Key6 { src, dst }))?
        }
        _ => return Some(TC_ACT_OK),
    };
    if let Some(counter) = COUNTERS.get_ptr_mut(verdict.counter) {
        // SAFETY: the pointer is this CPU's slot of the array, valid for the
        // program's run; TC programs are not preempted on their CPU.
        unsafe {
            (*counter).packets += 1;
            (*counter).bytes += u64::from(ctx.len());
        }
    }
    Some(match verdict.kind {
        kind::MARK => {
            // SAFETY: `skb` is the context the kernel passed in.
            let mark = unsafe { (*ctx.skb.skb).mark };
            ctx.set_mark((mark & !verdict.mask) | (verdict.mark & verdict.mask));
            TC_ACT_OK
        }
        kind::DROP => TC_ACT_SHOT,
        _ => TC_ACT_OK,
    })
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 11] = *b"Apache-2.0\0";
