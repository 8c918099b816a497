/* The hash behind validation signatures (count vectors, tensor lists):
 * splitmix64's finalizer over a running value. */
#include "gs_base.h"

uint64_t gs_hash_mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ull;
  return h ^ (h >> 29);
}
