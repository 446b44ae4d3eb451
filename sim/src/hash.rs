//! FNV-1a: the stable, cheap hash behind every deterministic choice the
//! simulator makes (reply lengths, logprobs, ids, padding).

/// FNV-1a's offset basis, the seed of a fresh hash.
pub const SEED: u64 = 0xcbf2_9ce4_8422_2325;

/// Folds `bytes` into `hash` (start from [`SEED`]).
pub fn fold(mut hash: u64, bytes: &[u8]) -> u64 {
    for byte in bytes {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// The hash of `parts`, each followed by a separator so that `["ab", "c"]`
/// and `["a", "bc"]` differ.
pub fn of(parts: &[&[u8]]) -> u64 {
    parts
        .iter()
        .fold(SEED, |hash, part| fold(fold(hash, part), &[0xff]))
}

/// `len` characters of `[0-9A-Za-z]` drawn from `seed`.
pub fn alphanumeric(seed: u64, len: usize) -> String {
    const ALPHABET: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    let mut state = seed;
    (0..len)
        .map(|index| {
            state = fold(state, &(index as u64).to_le_bytes());
            char::from(ALPHABET[(state % ALPHABET.len() as u64) as usize])
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_separated_and_strings_are_stable() {
        assert_ne!(of(&[b"ab", b"c"]), of(&[b"a", b"bc"]));
        assert_eq!(alphanumeric(7, 24), alphanumeric(7, 24));
        assert_ne!(alphanumeric(7, 24), alphanumeric(8, 24));
        assert_eq!(alphanumeric(7, 24).len(), 24);
        assert!(
            alphanumeric(9, 64)
                .chars()
                .all(|c| c.is_ascii_alphanumeric())
        );
    }
}
