package dev.cbserve.client;

/**
 * Token counts of one request.
 *
 * @param promptTokens prompt tokens (after tokenization / chat templating)
 * @param generatedTokens tokens generated so far (all of them on the final chunk)
 * @param cachedTokens prompt tokens whose KV cache came from the prefix cache
 */
public record Usage(int promptTokens, int generatedTokens, int cachedTokens) {}
