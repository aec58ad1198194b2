package dev.cbserve.client;

import java.util.List;

/**
 * The served model ({@link CbserveClient#modelInfo()}).
 *
 * @param modelName its name or path as the server loaded it
 * @param vocabSize size of the vocabulary: token ids must be below it
 * @param maxContextLength maximum tokens (prompt + generated) of one request
 * @param eosTokenIds the model's own end-of-sequence ids
 * @param hasChatTemplate whether chat prompts are accepted
 * @param hasTokenizer whether text prompts are accepted (and outputs carry text)
 * @param weightVersion version of the weights now served
 */
public record ModelInfo(
    String modelName,
    int vocabSize,
    int maxContextLength,
    List<Integer> eosTokenIds,
    boolean hasChatTemplate,
    boolean hasTokenizer,
    long weightVersion) {

  /** Copies {@code eosTokenIds} into an immutable list. */
  public ModelInfo {
    eosTokenIds = List.copyOf(eosTokenIds);
  }
}
