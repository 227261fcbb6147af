//! The record format the torture test and the drill write: fixed-size,
//! numbered, checksummed records, each at offset `seq * RECORD_SIZE`, so a
//! reader can tell exactly which records are present and intact.

use sha2::{Digest, Sha256};

pub const RECORD_SIZE: usize = 4096;
const MAGIC: &[u8; 8] = b"FCSIREC1";

/// Builds record `seq` (deterministic content, so it can be verified).
pub fn record(seq: u64) -> Vec<u8> {
    let mut r = vec![0u8; RECORD_SIZE];
    r[..8].copy_from_slice(MAGIC);
    r[8..16].copy_from_slice(&seq.to_le_bytes());
    let mut x = seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for b in r[16..RECORD_SIZE - 32].iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let sum = Sha256::digest(&r[..RECORD_SIZE - 32]);
    r[RECORD_SIZE - 32..].copy_from_slice(&sum);
    r
}

/// Whether `buf` is a valid record `seq`.
pub fn check(buf: &[u8], seq: u64) -> bool {
    buf.len() == RECORD_SIZE
        && &buf[..8] == MAGIC
        && buf[8..16] == seq.to_le_bytes()
        && Sha256::digest(&buf[..RECORD_SIZE - 32])[..] == buf[RECORD_SIZE - 32..]
}

/// Records `0..=last` that are missing or damaged in `data`.
pub fn missing(data: &[u8], last: u64) -> Vec<u64> {
    (0..=last)
        .filter(|&s| {
            let off = s as usize * RECORD_SIZE;
            data.get(off..off + RECORD_SIZE)
                .is_none_or(|b| !check(b, s))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_verify_and_damage_is_seen() {
        let mut data: Vec<u8> = (0..5).flat_map(record).collect();
        assert!(missing(&data, 4).is_empty());
        data[2 * RECORD_SIZE + 100] ^= 1;
        assert_eq!(missing(&data, 4), vec![2]);
        assert_eq!(missing(&data, 6), vec![2, 5, 6]);
    }
}
