package dev.cbserve.client;

import org.junit.jupiter.api.extension.ExtensionContext;
import org.junit.jupiter.api.extension.ParameterContext;
import org.junit.jupiter.api.extension.ParameterResolutionException;
import org.junit.jupiter.api.extension.ParameterResolver;

/**
 * Resolves a {@link CbserveServer} parameter with the one server of the test run: started on first
 * use, kept in the root context's store, and closed (the store closes {@link AutoCloseable}
 * values) when the whole run ends, whether the tests passed or not.
 */
final class CbserveServerExtension implements ParameterResolver {
  private static final ExtensionContext.Namespace NAMESPACE =
      ExtensionContext.Namespace.create(CbserveServerExtension.class);

  @Override
  public boolean supportsParameter(ParameterContext parameter, ExtensionContext context) {
    return parameter.getParameter().getType() == CbserveServer.class;
  }

  @Override
  public Object resolveParameter(ParameterContext parameter, ExtensionContext context) {
    return context
        .getRoot()
        .getStore(NAMESPACE)
        .computeIfAbsent(CbserveServer.class, key -> startServer(), CbserveServer.class);
  }

  /** Set when the server failed to start, so that the next test classes fail fast. */
  private static volatile ParameterResolutionException startFailure;

  private static CbserveServer startServer() {
    if (startFailure != null) {
      throw new ParameterResolutionException("the cbserve server failed to start", startFailure);
    }
    try {
      return CbserveServer.start();
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
      throw startFailure =
          new ParameterResolutionException("interrupted while starting the server", e);
    } catch (Exception e) {
      throw startFailure =
          new ParameterResolutionException("could not start the cbserve server: " + e, e);
    }
  }
}
