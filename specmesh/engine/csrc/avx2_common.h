static inline void store8_bf16(uint16_t* y, __m256 a) {
    __m256i u = _mm256_castps_si256(a);
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                             _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    u = _mm256_srli_epi32(u, 16);
    _mm_storeu_si128((__m128i*)y, _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
}
